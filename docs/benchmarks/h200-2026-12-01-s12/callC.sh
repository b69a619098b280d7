#!/bin/bash
# session 12, call C: plain decoding (device time per token) and DFlash rounds at 4-bit, 4k, with the new matmul issue path
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TORCHPY=/opt/torch/.venv/bin/python3
timeout 280 $TORCHPY -m benchmarks.plain_phases --scale full --quant 4bit --context 4096 --tokens 40 --passes 2 --kernels off,matmul,all --device-time --json $OUT/plain-phases-4bit-dev.json > $OUT/plain-phases-4bit-dev.txt 2>&1; echo pp rc=$?
grep -E "^\{|arm|median" $OUT/plain-phases-4bit-dev.txt | cut -c1-260 | tail -12
timeout 280 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 3 --plain-time --kernels off,all --json $OUT/rp-4bit-4k.json > $OUT/rp-4bit-4k.txt 2>&1; echo rp rc=$?
grep "^{" $OUT/rp-4bit-4k.txt | cut -c1-300 | tail -12
