#!/bin/bash
# session 23, call F1: why the cuda test saw no traced layer (diagnostic), then rounds with traced layers against without
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 60 python3 .sweep/s23/diag.py > $OUT/F1-diag.txt 2>&1; echo diag rc=$?; cat $OUT/F1-diag.txt | cut -c1-300 | tail -12
timeout ${T1:-300} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 6 --kernels default,default-traced --json $OUT/F-rp-traced.json > $OUT/F-rp-traced.txt 2>&1; echo rp rc=$?; grep '^{' $OUT/F-rp-traced.txt | grep -v '"rounds"' | cut -c1-260
