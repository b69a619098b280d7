#!/bin/bash
# session 14, call I: main with the default rule: the rule on the real backend (tiny model); rounds at 4-bit 4k, arms off / default / all
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 60 python3 .sweep/s14/default_probe.py > $OUT/default-probe.txt 2>&1; echo probe rc=$?
tail -3 $OUT/default-probe.txt | cut -c1-600
timeout ${RP:-200} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 2 --kernels off,default,all --json $OUT/rp-4bit-4k-default.json > $OUT/rp-4bit-4k-default.txt 2>&1; echo rp rc=$?
grep "^{" $OUT/rp-4bit-4k-default.txt | grep -v '"rounds"' | cut -c1-240
