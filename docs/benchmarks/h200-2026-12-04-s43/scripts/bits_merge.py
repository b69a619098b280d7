"""Session 43: the shipped merge (every split's load in flight) against the loop it
replaced (`mergeloop`, the text that ran before), bit for bit on the device with mlx's
graphs on: scaled and unscaled forms, one and two K groups, groups of 32 / 64 / 128,
4 / 8 bits and dense, 1 to 32 rows, Glimmer's shapes and others."""
import os
import sys

import mlx.core as mx

from benchmarks import matmul_variants
from dflash.metal import tensor_qmm as t

shapes = [(6656, 8704), (6656, 39936), (19968, 6656), (4096, 6656), (512, 300), (8192, 256)]
forms = [("1", "2"), ("1", "1"), ("0", "2"), ("0", "1")]  # (scaled, k groups)
mx.random.seed(0)
cases = []
for depth, cols in shapes:
    w = (mx.random.normal((cols, depth)) * 0.02).astype(mx.bfloat16)
    for bits, group in [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128), (None, None)]:
        wq, s, b = mx.quantize(w, group_size=group, bits=bits) if bits else (w, None, None)
        for rows in (1, 16, 17, 32):
            x = mx.random.normal((rows, depth)).astype(mx.bfloat16)
            cases.append((bits, group, depth, cols, rows, x, wq, s, b))


def outputs(scaled, groups):
    os.environ[t.SCALED_B_ENV] = scaled
    os.environ[t.TWO_K_GROUPS_ENV] = "1" if groups == "2" else "0"
    out = []
    for bits, group, depth, cols, rows, x, wq, s, b in cases:
        if scaled == "0" and bits is None:
            continue
        y = t.bind_tensor_core(rows, depth, wq, s, b, bits, group, mx.bfloat16)(x)
        mx.eval(y)
        out.append(((bits, group, depth, cols, rows), y))
    return out


bad = total = 0
for scaled, groups in forms:
    shipped = outputs(scaled, groups)
    with matmul_variants.variant(edits=("mergeloop",)):
        loop = outputs(scaled, groups)
    for (key, a), (_, b) in zip(shipped, loop):
        same = mx.array_equal(a, b).item()
        bad += not same
        total += 1
        if not same:
            print("DIFFERENT", scaled, groups, key)
    print(f"scaled={scaled} k_groups={groups}: {len(shipped)} cases", flush=True)
print("MISMATCHES", bad, "of", total)
sys.exit(1 if bad else 0)
