#!/bin/bash
# session 18, call A3 (inline command): rounds again, arms in the other order, 5 pairs
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1; mkdir -p $OUT; timeout 300 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 5 --kernels default-kgroups2,default --json $OUT/rp-4bit-4k-k2-b.json > $OUT/rp-4bit-4k-k2-b.txt 2>&1; echo rp rc=$?; grep "^{" $OUT/rp-4bit-4k-k2-b.txt | grep -v '"rounds"' | cut -c1-240
