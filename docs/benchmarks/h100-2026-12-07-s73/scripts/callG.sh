#!/bin/bash
# Session 72: the verify forward at groups of 32 and 128 (4 and 8 bits), every kernel part
# forced ("all") against mlx's forward ("off"); graphs off at 4 bits, on at 8 (their
# defaults at groups of 64). Decides whether a group size joins KERNELS_BY_QUANTIZATION.
# Usage, from the repository root with the tree in .sweep/s66/cur: bash callG.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/G
for qg in ${RUNS:-4bit-g32:0 8bit-g128:1 4bit-g128:0 8bit-g32:1}; do
  q=${qg%:*}; g=${qg#*:}
  t0=$(date +%s)
  (cd .sweep/s66/cur && PYTHONPATH=$PWD:/tmp/site MLX_USE_CUDA_GRAPHS=$g timeout ${PER:-140} python3 -m benchmarks.verify_forward --scale full --quant $q --context 4096 --kernels all,off --reps 4 --warmup 2 --device --device-forwards 4 --json $OUT/G/verify-$q-g$g.json > $OUT/G/verify-$q-g$g.txt 2>&1)
  echo "$q graphs=$g rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/G/verify-$q-g$g.txt | grep -v warn_once | tail -4 | cut -c1-300
done
