"""Session 42: the unrolled merge's bits against the shipped merge's (Glimmer shapes and
others, 4 / 8 bits and dense, 1 to 32 rows), on the device with mlx's graphs on."""
import sys

import mlx.core as mx

from benchmarks import matmul_variants
from dflash.metal import tensor_qmm as t

shapes = [(6656, 8704), (4096, 6656), (6656, 39936), (19968, 6656), (6656, 4096), (512, 300), (1024, 2304), (8192, 256)]
cases = []
for bits in (4, 8, None):
    for depth, cols in shapes:
        w = (mx.random.normal((cols, depth)) * 0.02).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=64, bits=bits) if bits else (w, None, None)
        for rows in (1, 5, 16, 17, 32):
            x = mx.random.normal((rows, depth)).astype(mx.bfloat16)
            cases.append((bits, depth, cols, rows, x, wq, s, b))


def outputs():
    out = []
    for bits, depth, cols, rows, x, wq, s, b in cases:
        y = t.bind_tensor_core(rows, depth, wq, s, b, bits, 64 if bits else None, mx.bfloat16)(x)
        mx.eval(y)
        out.append(y)
    return out


shipped = outputs()
with matmul_variants.variant(edits=("mergeunrolled",)):
    unrolled = outputs()
bad = 0
for case, a, b in zip(cases, shipped, unrolled):
    bits, depth, cols, rows = case[:4]
    splits = t.split_plan(depth, cols, bits, True)[1]
    same = mx.array_equal(a, b).item()
    bad += not same
    print(f"bits={bits} K={depth} N={cols} rows={rows} splits={splits} same={same}")
print("MISMATCHES", bad, "of", len(cases))
sys.exit(1 if bad else 0)
