#!/bin/bash
# session 20, call K: whole rounds, head prep on (default) against off (default-unprepared), 4-bit 4k, tau 6; two processes, arms in both orders
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
rounds() { timeout ${RT:-130} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 4 --kernels $2 --json $OUT/rp-$1.json > $OUT/rp-$1.txt 2>&1; echo rp $1 rc=$?; grep '^{' $OUT/rp-$1.txt | grep -v '"rounds"' | cut -c1-220; }
rounds ab1 default,default-unprepared; rounds ab2 default-unprepared,default
