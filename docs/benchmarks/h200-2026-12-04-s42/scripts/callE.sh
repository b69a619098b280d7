#!/bin/bash
# session 42, call E: with MAX_CLUSTER = 4 (down's 5-way split keeps the merge), graphs off: per-call times, then the loop with the
# cluster sum off and on (one process each, pacing arms 0 and 4, every run checked lossless).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
S="mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj"
MLX_USE_CUDA_GRAPHS=0 timeout 80 python3 -m benchmarks.matmul_variants --rows 16 --reps 20 --variants current,cluster --shapes "$S" --json $OUT/E-nographs16.json > $OUT/E-nographs16.txt 2>&1; echo ng16 rc=$?
A="--scale full --quant 4bit --context 4096 --tokens 96 --arms 0,4 --reps 4"
MLX_USE_CUDA_GRAPHS=0 DFLASH_QMM_CLUSTER_SUM=1 timeout 170 python3 -m benchmarks.pacing_ab $A --json $OUT/E-nographs-cluster.json 2>&1 | grep -v Warning | tail -2; echo cluster rc=$?
MLX_USE_CUDA_GRAPHS=0 DFLASH_QMM_CLUSTER_SUM=0 timeout 170 python3 -m benchmarks.pacing_ab $A --json $OUT/E-nographs.json 2>&1 | grep -v Warning | tail -2; echo nographs rc=$?
python3 - <<'PY'
import json, os, statistics
d = json.load(open(os.environ["OUT"] + "/E-nographs16.json"))
for r in d["rows"]:
    print(f'{r["rows"]:2d} {r["projection"][:22]:22s} {r["variant"]:10s} {r["device_us"]:8.2f} {r["over_bound"]:5.2f}x diff={r.get("max_abs_diff_vs_mlx")}')
for f in ("E-nographs-cluster.json", "E-nographs.json"):
    try:
        d = json.load(open(os.environ["OUT"] + "/" + f))
    except Exception as e:
        print(f, e); continue
    print(f, "plain", round(statistics.median(d["plain_ms"]), 1), "median", d["median_ms"], "x_plain", d["x_plain"], "rounds", d["round_median_ms"], "lossless", d["all_lossless"], "runs", d["ms"])
PY
