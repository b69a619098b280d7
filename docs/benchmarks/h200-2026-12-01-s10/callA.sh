#!/bin/bash
# session 10, call A: where our plain decoding's host time goes with the attention part (bf16 4k)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TP=/opt/torch/.venv/bin/python3
git log --oneline -1 > $OUT/commit.txt 2>&1
timeout 420 $TP -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 6 --max-tokens 48 --runs 1 --kernels off,attention --device-time --plain-time --profile-plain 30 --json $OUT/rp-diag-bf16-4k.json > $OUT/rp-diag.txt 2>&1
echo rc=$?
grep "^{" $OUT/rp-diag.txt | cut -c1-200
