#!/bin/bash
# session 14, call B: plain decoding and DFlash rounds at 4-bit, 4k: off, all, all-merged (split sum and fold merged)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TORCHPY=/opt/torch/.venv/bin/python3
timeout ${PP:-290} $TORCHPY -m benchmarks.plain_phases --scale full --quant 4bit --context 4096 --tokens 40 --passes 2 --kernels off,all,all-merged --device-time --json $OUT/plain-phases-4bit-fold.json > $OUT/plain-phases-4bit-fold.txt 2>&1; echo pp rc=$?
grep -E "^\{" $OUT/plain-phases-4bit-fold.txt | cut -c1-300 | tail -12
timeout ${RP:-280} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 3 --plain-time --kernels off,all,all-merged --json $OUT/rp-4bit-4k-fold.json > $OUT/rp-4bit-4k-fold.txt 2>&1; echo rp rc=$?
grep "^{" $OUT/rp-4bit-4k-fold.txt | cut -c1-300 | tail -14
