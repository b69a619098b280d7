#!/bin/bash
# session 42, call D: the loop (4-bit full-size Glimmer, 4k, replay tau 6) with mlx's CUDA graphs on (default; the cluster sum refused),
# graphs off without the cluster sum, graphs off with it: one process each, pacing arms 0 and 4, every run checked lossless.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
A="--scale full --quant 4bit --context 4096 --tokens 96 --arms 0,4 --reps 4"
timeout 190 python3 -m benchmarks.pacing_ab $A --json $OUT/D-graphs.json 2>&1 | grep -v Warning | tail -4; echo graphs rc=$?
MLX_USE_CUDA_GRAPHS=0 DFLASH_QMM_CLUSTER_SUM=0 timeout 190 python3 -m benchmarks.pacing_ab $A --json $OUT/D-nographs.json 2>&1 | grep -v Warning | tail -4; echo nographs rc=$?
MLX_USE_CUDA_GRAPHS=0 DFLASH_QMM_CLUSTER_SUM=1 timeout 190 python3 -m benchmarks.pacing_ab $A --json $OUT/D-nographs-cluster.json 2>&1 | grep -v Warning | tail -4; echo cluster rc=$?
python3 - <<'PY'
import json, os
for f in ("D-graphs.json", "D-nographs.json", "D-nographs-cluster.json"):
    try:
        d = json.load(open(os.environ["OUT"] + "/" + f))
    except Exception as e:
        print(f, e); continue
    import statistics
    print(f, "plain", round(statistics.median(d["plain_ms"]), 1), "median", d["median_ms"], "x_plain", d["x_plain"], "rounds", d["round_median_ms"], "lossless", d["all_lossless"], "total", d["total_s"])
PY
