#!/bin/bash
# session 42, call C: with mlx's CUDA graphs off, the cluster sum's bits (and the tile-major order's) against the merge's;
# device times with graphs off (cluster, tile-major) and on (tile-major).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
MLX_USE_CUDA_GRAPHS=0 timeout 200 python3 .sweep/s42/bits.py > $OUT/C-bits-nographs.txt 2>&1; echo bits rc=$?
grep -c "cluster_same=True tilemajor_same=True" $OUT/C-bits-nographs.txt; grep -v "cluster_same=True tilemajor_same=True" $OUT/C-bits-nographs.txt | head -12
S="mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj"
MLX_USE_CUDA_GRAPHS=0 timeout 150 python3 -m benchmarks.matmul_variants --rows 16 --reps 20 --variants current,cluster,tilemajor,cluster-overhead2 --shapes "$S" --json $OUT/C-nographs16.json > $OUT/C-nographs16.txt 2>&1; echo ng16 rc=$?
MLX_USE_CUDA_GRAPHS=0 timeout 80 python3 -m benchmarks.matmul_variants --rows 1 --reps 20 --variants current,cluster,tilemajor --shapes "$S" --json $OUT/C-nographs1.json > $OUT/C-nographs1.txt 2>&1; echo ng1 rc=$?
timeout 100 python3 -m benchmarks.matmul_variants --rows 16 --reps 20 --variants current,tilemajor --shapes "$S" --json $OUT/C-graphs16.json > $OUT/C-graphs16.txt 2>&1; echo g16 rc=$?
python3 - <<'PY'
import json, os
for f in ("C-nographs16.json", "C-nographs1.json", "C-graphs16.json"):
    try:
        d = json.load(open(os.environ["OUT"] + "/" + f))
    except Exception as e:
        print(f, e); continue
    print(f)
    for r in d["rows"]:
        print(f'{r["rows"]:2d} {r["projection"][:22]:22s} {r["variant"]:18s} {r["device_us"]:8.2f} {r["over_bound"]:5.2f}x k={r["kernels_per_call"]} diff={r.get("max_abs_diff_vs_mlx")}')
    print("errors", d.get("errors"))
PY
