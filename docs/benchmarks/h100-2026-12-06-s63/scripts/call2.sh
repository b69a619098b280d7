#!/bin/bash
# Call 2: bf16's verify forward on the device: a round's device time (CUPTI, rounds
# less the draft) and the drafter's own parts, this tree, graphs off.
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/B
cd .sweep/s63/cur
export PYTHONPATH=$PWD:/tmp/site MLX_USE_CUDA_GRAPHS=0
t0=$(date +%s)
timeout ${T1:-330} python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --max-tokens 64 --runs 1 --kernels default --device-time --json $OUT/B/round-bf16.json > $OUT/B/round-bf16.txt 2>&1
echo "round bf16 rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/B/round-bf16.txt | grep -E "busy_ms|round_median" | cut -c1-600
t0=$(date +%s)
timeout ${T2:-220} python3 -m benchmarks.drafter_forward --scale full --quant bf16 --context 4096 --kernels default --device --json $OUT/B/drafter-bf16.json > $OUT/B/drafter-bf16.txt 2>&1
echo "drafter bf16 rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/B/drafter-bf16.txt | tail -12 | cut -c1-400
