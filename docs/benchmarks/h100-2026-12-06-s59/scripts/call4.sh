#!/bin/bash
# Session 59, call 4: rounds with / without the prefetch, arms reversed, and 32 MB.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/R
Q=${1:-4bit}; TAG=${2:-b}; ARMS=${3:-default-unfetched,default,default-fetched32}
timeout 280 python3 -m benchmarks.round_profile --scale full --quant $Q --context 4096 --max-tokens 64 --runs 2 --kernels $ARMS --device-time --json $OUT/R/rounds-$Q-$TAG.json > $OUT/R/rounds-$Q-$TAG.txt 2>&1
echo "round_profile rc=$?"
grep -v Warning $OUT/R/rounds-$Q-$TAG.txt | grep -E "round_median|lossless|error|Error" | cut -c1-250; python3 .sweep/s59/summ.py $OUT/R/rounds-$Q-$TAG.json
