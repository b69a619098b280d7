#!/bin/bash
# session 10, call D: attention / attention+projections vs off, 8 alternating runs (bf16 4k)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
A="--scale full --context 4096 --tau 6 --max-tokens 64 --runs 8 --plain-time"
timeout 330 python3 -m benchmarks.round_profile $A --quant bf16 --kernels off,attention,attention-projections --json $OUT/rp-ab8-bf16-4k.json > $OUT/rp-ab8-bf16.txt 2>&1; echo rc=$?
timeout 60 python3 -m pytest -q -p no:cacheprovider -x tests/test_fused_projections.py > $OUT/pytest-fused.txt 2>&1; echo pytest rc=$?; tail -3 $OUT/pytest-fused.txt
