#!/bin/bash
# session 9, call D: fused sibling projections in the loop (4-bit, bf16), device time per round
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TP=/opt/torch/.venv/bin/python3
timeout 60 $TP -m benchmarks.launch_cost --calls 100 --reps 5 --device-time --json $OUT/launch-graphs.json > $OUT/launch-graphs.txt 2>&1; grep "^{" $OUT/launch-graphs.txt
timeout 250 $TP -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 96 --runs 2 --kernels off,all,all-unfused --device-time --json $OUT/rp-dev-4bit-4k.json 2>&1 | grep "^{" | cut -c1-300
timeout 220 $TP -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 6 --max-tokens 96 --runs 1 --kernels off,attention,all,all-unfused --device-time --json $OUT/rp-dev-bf16-4k.json 2>&1 | grep "^{" | cut -c1-300
