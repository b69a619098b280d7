#!/bin/bash
# session 14, call H: main (merged split sum, fold as its own launch): DFlash rounds at 4-bit, 4k (5 runs) and 32k (2 runs), arms off and all
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${R4:-200} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 5 --kernels off,all --json $OUT/rp-4bit-4k-main.json > $OUT/rp-4bit-4k-main.txt 2>&1; echo rp4k rc=$?
grep "^{" $OUT/rp-4bit-4k-main.txt | grep round_median | cut -c1-240
timeout ${R32:-330} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 32768 --tau 6 --max-tokens 64 --runs 2 --kernels off,all --json $OUT/rp-4bit-32k-main.json > $OUT/rp-4bit-32k-main.txt 2>&1; echo rp32k rc=$?
grep "^{" $OUT/rp-4bit-32k-main.txt | cut -c1-240 | tail -6
