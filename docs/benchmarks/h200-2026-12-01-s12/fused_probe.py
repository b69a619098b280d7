"""Which small_row_matmul geometries of test_each_member_gets_its_own_columns miss the reference."""
import itertools, sys
import mlx.core as mx, mlx.nn as nn, numpy as np
from dflash.metal.qmm import small_row_matmul
bad = 0
for quant, dtype, rows, width in itertools.product([(None, None), (4, 32), (8, 64), (4, 128)], [mx.float32, mx.bfloat16], [1, 3, 8, 16, 17, 20], [32, 64, 96, 160]):
    bits, group = quant
    for seed in range(3):
        mx.random.seed(seed)
        layer = nn.Linear(128, width, bias=False); layer.set_dtype(dtype)
        if bits: layer = nn.QuantizedLinear.from_linear(layer, group_size=group, bits=bits)
        mx.eval(layer.parameters())
        x = mx.random.normal((rows, 128)).astype(dtype)
        args = (x, layer["weight"], layer["scales"] if bits else None, layer["biases"] if bits else None)
        kw = dict(bits=bits, group_size=group)
        got = np.array(small_row_matmul(*args, **kw, use_kernel=True).astype(mx.float32))
        want = np.array(small_row_matmul(*args, **kw, use_kernel=False).astype(mx.float32))
        if not np.allclose(got, want, rtol=2e-2, atol=2e-2):
            bad += 1
            print("BAD", quant, dtype, rows, width, seed, float(np.nanmax(np.abs(got - want))), flush=True)
print("bad", bad)
