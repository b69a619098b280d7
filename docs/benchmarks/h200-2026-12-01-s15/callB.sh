#!/bin/bash
# session 15, call B: CUDA graphs off (MLX_USE_CUDA_GRAPHS=0) vs on; arms off / all / all-compiled; rounds (tau 6) and plain tokens at 4-bit 4k; plain_phases build split
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
MLX_USE_CUDA_GRAPHS=0 timeout ${R1:-200} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 2 --plain-time --kernels off,all,all-compiled --json $OUT/rp-4bit-4k-nographs.json > $OUT/rp-4bit-4k-nographs.txt 2>&1; echo rp-nographs rc=$?
grep "^{" $OUT/rp-4bit-4k-nographs.txt | grep -v '"rounds"' | cut -c1-240
timeout ${PP:-160} python3 -m benchmarks.plain_phases --scale full --quant 4bit --context 4096 --tokens 40 --passes 2 --kernels off,all,all-compiled --json $OUT/plain-phases-compiled.json > $OUT/plain-phases-compiled.txt 2>&1; echo pp rc=$?
grep -E "^\{" $OUT/plain-phases-compiled.txt | cut -c1-200 | tail -8
timeout ${R2:-200} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 2 --plain-time --kernels off,all,all-compiled --json $OUT/rp-4bit-4k-graphs.json > $OUT/rp-4bit-4k-graphs.txt 2>&1; echo rp-graphs rc=$?
grep "^{" $OUT/rp-4bit-4k-graphs.txt | grep -v '"rounds"' | cut -c1-240
