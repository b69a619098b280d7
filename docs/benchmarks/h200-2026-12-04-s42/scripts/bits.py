"""Session 42: the cluster sum's and the tile-major order's bits against the merge's,
Glimmer shapes and a few others, on the device (every row count, 4 / 8 bits, dense)."""
import os
import sys

import mlx.core as mx

from benchmarks import matmul_variants
from dflash.metal import tensor_qmm as t

print("graphs", t.mlx_cuda_graphs(), "device_clusters", t.device_clusters())
shapes = [(6656, 8704), (4096, 6656), (6656, 39936), (19968, 6656), (6656, 4096), (4096, 1000), (512, 300), (1024, 2304)]
bad = 0
for bits in (4, 8, None):
    for depth, cols in shapes:
        w = (mx.random.normal((cols, depth)) * 0.02).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=64, bits=bits) if bits else (w, None, None)
        for rows in (1, 5, 16, 17, 32):
            x = mx.random.normal((rows, depth)).astype(mx.bfloat16)
            outs, names = {}, {}
            for arm in ("merge", "cluster", "tilemajor"):
                os.environ[t.CLUSTER_SUM_ENV] = "1" if arm == "cluster" else "0"
                edits = ("tilemajor",) if arm == "tilemajor" else ()
                with matmul_variants.variant(edits=edits):
                    f = t.bind_tensor_core(rows, depth, wq, s, b, bits, 64 if bits else None, mx.bfloat16)
                    y = f(x)
                    mx.eval(y)
                    outs[arm] = y
                    names[arm] = t.launch_plan(rows, depth, cols, bits, 64 if bits else None, True, False, True, 2, (), False, bits is not None, arm == "cluster" and t.cluster_sum()).spec.base
            ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=bits) if bits else x @ w.T
            err = mx.abs(outs["merge"].astype(mx.float32) - ref.astype(mx.float32)).max().item()
            same_c = mx.array_equal(outs["merge"], outs["cluster"]).item()
            same_t = mx.array_equal(outs["merge"], outs["tilemajor"]).item()
            bad += (not same_c) + (not same_t) + (err > 0.5)
            print(f"bits={bits} K={depth} N={cols} rows={rows} {names['cluster']} cluster_same={same_c} tilemajor_same={same_t} merge_vs_mlx={err:.4f}")
print("MISMATCHES", bad)
sys.exit(1 if bad else 0)
