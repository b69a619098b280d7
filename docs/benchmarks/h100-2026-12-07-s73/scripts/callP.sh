#!/bin/bash
# Session 73: our plain 4-bit decoding (groups of 64) with the kernels against kernels off
# and mlx-lm's own (plain_phases), with mlx's CUDA graphs off (the 4-bit default), then on.
# Usage, from the repository root with the tree in .sweep/s66/cur: bash callP.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/P
for g in 0 1; do
  t0=$(date +%s)
  (cd .sweep/s66/cur && PYTHONPATH=$PWD:/tmp/site MLX_USE_CUDA_GRAPHS=$g timeout ${PER:-82} python3 -m benchmarks.plain_phases --scale full --quant 4bit --context 4096 --tokens 40 --passes ${PASSES:-2} --kernels default,off --json $OUT/P/plain-4bit-g$g.json > $OUT/P/plain-4bit-g$g.txt 2>&1)
  echo "graphs=$g rc=$? $(( $(date +%s)-t0 ))s"; grep '"arm"' $OUT/P/plain-4bit-g$g.txt | cut -c1-250
done
