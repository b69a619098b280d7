#!/bin/bash
# session 10, call B: the projections part (sibling sets as one mlx matmul) in rounds and
# plain decoding, bf16 and 4-bit at 4k; and mlx's graph size (MLX_MAX_OPS_PER_BUFFER)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
A="--scale full --context 4096 --tau 6 --max-tokens 96 --runs 2 --plain-time"
K="--kernels off,projections,attention-projections,attention"
timeout 230 python3 -m benchmarks.round_profile $A --quant bf16 $K --json $OUT/rp-proj-bf16-4k.json 2>&1 | grep "^{" | cut -c1-260
timeout 230 python3 -m benchmarks.round_profile $A --quant 4bit $K --json $OUT/rp-proj-4bit-4k.json 2>&1 | grep "^{" | cut -c1-260
MLX_MAX_OPS_PER_BUFFER=400 timeout 130 python3 -m benchmarks.round_profile $A --quant bf16 --kernels off,projections --json $OUT/rp-ops400-bf16-4k.json 2>&1 | grep "^{" | cut -c1-260
timeout 120 python3 -m pytest -q -p no:cacheprovider -x tests/test_fused_projections.py 2>&1 | tail -3
