#!/bin/bash
# session 10, call E: both parts vs off at 4-bit, 5 alternating runs (4k)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
A="--scale full --context 4096 --tau 6 --max-tokens 64 --runs 5 --plain-time"
timeout 290 python3 -m benchmarks.round_profile $A --quant 4bit --kernels off,all,all-unfused --json $OUT/rp-ab5-4bit-4k.json > $OUT/rp-ab5-4bit.txt 2>&1; echo rc=$?
grep '"runs"' $OUT/rp-ab5-4bit.txt | cut -c1-250
