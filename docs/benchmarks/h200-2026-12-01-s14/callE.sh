#!/bin/bash
# session 14, call E: DFlash rounds in bf16 at 4k (off, all, all-merged); cProfile of our plain decoding at 4-bit (off, all-merged)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${RB:-300} python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 6 --max-tokens 64 --runs 2 --plain-time --kernels off,all,all-merged --json $OUT/rp-bf16-4k-fold.json > $OUT/rp-bf16-4k-fold.txt 2>&1; echo rp-bf16 rc=$?
grep "^{" $OUT/rp-bf16-4k-fold.txt | cut -c1-240 | tail -8
timeout ${PR:-200} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 1 --profile-plain 30 --kernels off,all-merged --json $OUT/rp-4bit-profile-plain.json > $OUT/rp-4bit-profile-plain.txt 2>&1; echo prof rc=$?
tail -5 $OUT/rp-4bit-profile-plain.txt | cut -c1-200
