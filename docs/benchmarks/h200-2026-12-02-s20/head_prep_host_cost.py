"""Host cost of one head prep call (launch stubbed) against mlx-lm's five ops, CPU."""

import time, mlx.core as mx
from dflash.metal import heads, groups, backend

q = mx.zeros((1, 16, 32, 128), mx.bfloat16)
k = mx.zeros((1, 16, 2, 128), mx.bfloat16)
mx.eval(q, k)
outs = [mx.zeros((1, 16, 32, 128), mx.bfloat16), mx.zeros((1, 16, 2, 128), mx.bfloat16)]
groups.launch_groups = lambda *a, **kw: outs
backend.BACKEND = "cuda"
args = dict(eps=1e-5, q_scale=3.87, rope_base=500000.0, rope_scale=1.0)


def ours(i):
    return heads.head_prep(q, k, start=4000 + i, use_kernel=True, **args)


def ref(i):
    return heads.head_prep(q, k, start=4000 + i, use_kernel=False, **args)


def mlxlm(i):
    a = mx.fast.rms_norm(q, None, 1e-5) * 3.87
    b = mx.fast.rms_norm(k, None, 1e-5)
    a = a.transpose(0, 2, 1, 3)
    b = b.transpose(0, 2, 1, 3)
    return mx.fast.rope(
        a, 128, traditional=False, base=500000.0, scale=1.0, offset=4000 + i
    ), mx.fast.rope(
        b, 128, traditional=False, base=500000.0, scale=1.0, offset=4000 + i
    )


for f in (ours, ref, mlxlm, ours):
    n = 3000
    t = time.perf_counter()
    for i in range(n):
        f(i)
    print(f.__name__, (time.perf_counter() - t) / n * 1e6, "us")
