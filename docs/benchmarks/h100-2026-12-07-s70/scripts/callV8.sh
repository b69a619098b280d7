#!/bin/bash
# Session 70's next 8-bit step: the verify forward with our matmul / every part against
# mlx's (graphs off, then on), then whole 8-bit loops K (kernels, graphs off) against N
# (mlx's matmuls, graphs on) and M (kernels, graphs on). Not run yet. Usage, from the
# repository root with this folder's loop.sh and gcwrap.py in .sweep/s66/ and the tree
# in .sweep/s66/cur: bash callV8.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/V
nvidia-smi --query-gpu=name --format=csv,noheader
ROOT=$PWD
for g in 0 1; do
  t0=$(date +%s)
  (cd .sweep/s66/cur && PYTHONPATH=$PWD:/tmp/site MLX_USE_CUDA_GRAPHS=$g timeout ${PER:-150} python3 -m benchmarks.verify_forward --scale full --quant 8bit --context 4096 --kernels all,matmul,off --reps 5 --warmup 2 --device --device-forwards 6 --json $OUT/V/verify-8bit-g$g.json > $OUT/V/verify-8bit-g$g.txt 2>&1)
  echo "graphs=$g rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/V/verify-8bit-g$g.txt | grep -v warn_once | tail -4 | cut -c1-300
done
QUANT=8bit PER=${LPER:-120} bash $ROOT/.sweep/s66/loop.sh "${LOOPS:-K N M K N M}"
