#!/bin/bash
# session 9, call F: plain decoding's wall time with and without the attention part (bf16 4k)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 175 python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 6 --max-tokens 48 --runs 1 --kernels off,attention --plain-time --json $OUT/rp-plain-bf16-4k.json 2>&1 | grep "^{" | cut -c1-300
