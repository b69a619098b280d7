#!/bin/bash
# session 11, call C: plain decoding's slow tokens (per-token walls), with and without mlx's CUDA graphs (4-bit, 4k)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
P="--scale full --quant 4bit --context 4096 --tokens 64 --passes 2 --kernels off,attention,matmul,all"
timeout 170 python3 -m benchmarks.plain_phases $P --json $OUT/plain-phases-tokens.json > $OUT/plain-phases-tokens.txt 2>&1; echo rc=$?
grep '"arm"' $OUT/plain-phases-tokens.txt | grep -v extra | cut -c1-260
MLX_USE_CUDA_GRAPHS=0 timeout 150 python3 -m benchmarks.plain_phases $P --passes 1 --json $OUT/plain-phases-nographs.json > $OUT/plain-phases-nographs.txt 2>&1; echo rc=$?
grep '"arm"' $OUT/plain-phases-nographs.txt | grep -v extra | cut -c1-260
