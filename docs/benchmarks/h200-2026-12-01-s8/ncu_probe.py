import sys
import mlx.core as mx
from dflash.metal import attention, tensor_attention
from dflash.metal.attention import KeyPlane, small_query_attention
layout = sys.argv[1] if len(sys.argv) > 1 else "stream"
attention.TENSOR_LAYOUT = tensor_attention.LAYOUTS[layout]
dt = mx.bfloat16
q = mx.random.normal((1, 32, 16, 128)).astype(dt)
k = mx.random.normal((1, 2, 4352, 128)).astype(dt)
v = mx.random.normal((1, 2, 4352, 128)).astype(dt)
bk = mx.random.normal((1, 2, 16, 128)).astype(dt)
bv = mx.random.normal((1, 2, 16, 128)).astype(dt)
plane = KeyPlane(k, v, 4096, 0, 0)
for _ in range(3):
    mx.eval(small_query_attention(q, plane, bk, bv, scale=128**-0.5, use_kernel=True))
print("done", layout)
