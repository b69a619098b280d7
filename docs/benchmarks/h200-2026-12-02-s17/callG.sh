#!/bin/bash
# session 17, call G (run as an inline command): the 8-bit candidate again, 5 more pairs (kernels off vs every part, 4k, tau 6)
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1; mkdir -p $OUT; timeout 420 python3 -m benchmarks.round_profile --scale full --quant 8bit --context 4096 --tau 6 --max-tokens 64 --runs 5 --kernels off,all --json $OUT/rp-8bit-4k-b.json > $OUT/rp-8bit-4k-b.txt 2>&1; echo rp rc=$?; grep "^{" $OUT/rp-8bit-4k-b.txt | grep -v '"rounds"' | cut -c1-240
