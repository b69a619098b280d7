#!/bin/bash
# session 9, call C: host cost after the plan cache; in-loop A/B with device time
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TP=/opt/torch/.venv/bin/python3
git log --oneline -1 > $OUT/commit.txt 2>&1
timeout 45 $TP -m benchmarks.launch_cost --device-time --json $OUT/launch-graphs.json --cprofile "ours small_row_matmul" > $OUT/launch-graphs.txt 2>&1; head -7 $OUT/launch-graphs.txt | grep "^{"
timeout 250 $TP -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 96 --runs 2 --kernels off,all --device-time --json $OUT/rp-dev-4bit-4k.json 2>&1 | grep "^{" | cut -c1-300
timeout 200 python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 6 --max-tokens 96 --runs 2 --kernels off,attention --json $OUT/rp-bf16-4k.json 2>&1 | grep "^{" | cut -c1-300
