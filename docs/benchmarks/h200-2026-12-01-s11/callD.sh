#!/bin/bash
# session 11, call D: plain decoding per token two ways in one process (yield intervals, and two whole generations' difference), then round_profile's plain-time after DFlash runs (4-bit, 4k)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 200 python3 -m benchmarks.plain_phases --scale full --quant 4bit --context 4096 --tokens 64 --passes 2 --kernels off,all --difference --json $OUT/plain-phases-difference.json > $OUT/plain-phases-difference.txt 2>&1; echo rc=$?
grep '"arm"' $OUT/plain-phases-difference.txt | grep -v extra | cut -c1-300
timeout 200 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 1 --plain-time --kernels off,all --json $OUT/rp-plain-4bit-4k.json > $OUT/rp-plain-4bit.txt 2>&1; echo rp rc=$?
grep '"runs"\|ms_per_token' $OUT/rp-plain-4bit.txt | cut -c1-250
