"""Host cost per call on the GPU machine: the residual-norm kernel's wrapper + binding
against mlx's three ops (rms_norm, add, rms_norm), build alone and build + encode."""
import json, os, statistics, sys, time
import mlx.core as mx
from dflash.metal import norms, heads

rows, dim = 16, 6656
k = mx.random.split(mx.random.key(0), 4)
x, r = [(mx.random.normal((1, rows, dim), key=kk) * 2).astype(mx.bfloat16) for kk in k[:2]]
w, w2 = [(1 + 0.1 * mx.random.normal((dim,), key=kk)).astype(mx.bfloat16) for kk in k[2:]]
q = mx.random.normal((1, rows, 32, 128)).astype(mx.bfloat16)
kk_ = mx.random.normal((1, rows, 2, 128)).astype(mx.bfloat16)
mx.eval(x, r, w, w2, q, kk_)
def direct(fn):
    os.environ["DFLASH_COMPILE"] = "0"
    try:
        return fn()
    finally:
        os.environ.pop("DFLASH_COMPILE", None)


arms = {
    "kernel": lambda: norms.residual_norm(x, r, w, 1e-8, next_weight=w2, next_eps=1e-5, use_kernel=True),
    "mlx-ops": lambda: norms.residual_norm(x, r, w, 1e-8, next_weight=w2, next_eps=1e-5, use_kernel=False),
    "kernel-direct": lambda: direct(lambda: norms.residual_norm(x, r, w, 1e-8, next_weight=w2, next_eps=1e-5, use_kernel=True)),
    "head-prep-direct": lambda: direct(lambda: heads.head_prep(q, kk_, eps=1e-5, q_scale=3.87, rope_base=5e5, start=4096, use_kernel=True)),
    "kernel-tail": lambda: norms.residual_norm(x, r, w, 1e-8, use_kernel=True),
    "mlx-tail": lambda: norms.residual_norm(x, r, w, 1e-8, use_kernel=False),
    "head-prep": lambda: heads.head_prep(q, kk_, eps=1e-5, q_scale=3.87, rope_base=5e5, start=4096, use_kernel=True),
    "rms-norm": lambda: (mx.fast.rms_norm(x, w, 1e-5),),
    "add": lambda: (x + r,),
}
out = []
N = 400
for rep in range(5):
    for name, fn in arms.items():
        mx.eval([a for a in fn() if a is not None])
        t0 = time.perf_counter(); outs = [fn() for _ in range(N)]; t1 = time.perf_counter()
        flat = [a for o in outs for a in o if a is not None]
        mx.async_eval(flat); t2 = time.perf_counter(); mx.eval(flat); t3 = time.perf_counter()
        row = {"rep": rep, "arm": name, "build_us": round((t1 - t0) / N * 1e6, 2),
               "encode_us": round((t2 - t1) / N * 1e6, 2), "wall_us": round((t3 - t0) / N * 1e6, 2)}
        out.append(row); print(json.dumps(row), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
