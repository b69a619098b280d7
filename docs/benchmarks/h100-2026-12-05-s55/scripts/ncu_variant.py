"""One 4-bit shape under one matmul_variants variant, called a few times (for ncu's --launch-skip)."""
import sys

import mlx.core as mx

from benchmarks import matmul_variants
from dflash.metal.qmm import small_row_matmul

name = sys.argv[1]
depth, columns, rows = (int(t) for t in sys.argv[2:5])
dense = (0.02 * mx.random.normal((columns, depth))).astype(mx.bfloat16)
weight, scales, biases = mx.quantize(dense, group_size=64, bits=4)
x = mx.random.normal((rows, depth)).astype(mx.bfloat16)
mx.eval(weight, scales, biases, x)
with matmul_variants.variant(**matmul_variants.VARIANTS[name]):
    for _ in range(4):
        mx.eval(small_row_matmul(x, weight, scales, biases, bits=4, group_size=64, use_kernel=True))
        mx.eval(mx.quantized_matmul(x, weight, scales, biases, transpose=True, group_size=64, bits=4))
print("done", name, depth, columns, rows)
