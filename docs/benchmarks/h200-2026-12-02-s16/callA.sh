#!/bin/bash
# session 16, call A: cProfile of DFlash rounds per kernel arm (off / default), 4-bit 4k, tau 6: where the verify forward's host time goes
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -c "import mlx.core as mx; from dflash.metal.backend import compile_wanted; print(mx.default_device(), compile_wanted())"
timeout ${R1:-300} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 1 --kernels off,default --profile 70 --json $OUT/rp-4bit-4k-profile.json > $OUT/rp-4bit-4k-profile.txt 2>&1; echo rp rc=$?
grep "^{" $OUT/rp-4bit-4k-profile.txt | cut -c1-300
grep -A 45 "^# DFlash rounds" $OUT/rp-4bit-4k-profile.txt | cut -c1-150
