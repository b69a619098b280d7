#!/bin/bash
# session 9, call B: kernels and device time per round / token, by kernel arm (CUPTI)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TP=/opt/torch/.venv/bin/python3
timeout 250 $TP -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 6 --max-tokens 48 --runs 1 --kernels off,attention,matmul,all --device-time --json $OUT/rp-dev-bf16-4k.json 2>&1 | grep "^{" | cut -c1-300
timeout 250 $TP -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 48 --runs 1 --kernels off,all --device-time --json $OUT/rp-dev-4bit-4k.json 2>&1 | grep "^{" | cut -c1-300
