#!/bin/bash
# session 10, call C: projections part A/B with alternating runs and CUPTI device time
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TP=/opt/torch/.venv/bin/python3
timeout 90 python3 -m pytest -q -p no:cacheprovider -x tests/test_fused_projections.py 2>&1 | tail -2
A="--scale full --context 4096 --tau 6 --max-tokens 64 --runs 6 --plain-time --device-time"
timeout 260 $TP -m benchmarks.round_profile $A --quant bf16 --kernels off,projections,attention-projections --json $OUT/rp-ab-bf16-4k.json > $OUT/rp-ab-bf16.txt 2>&1; echo rc=$?
timeout 200 $TP -m benchmarks.round_profile $A --quant 4bit --kernels off,projections --json $OUT/rp-ab-4bit-4k.json > $OUT/rp-ab-4bit.txt 2>&1; echo rc=$?
