#!/bin/bash
# Session 72, for an H200 (none came; not run): the verify-forward goals with today's defaults against
# mlx's forward: 4-bit (graphs off, its default) and bf16 (graphs on, its default; then off).
# Usage, from the repository root with the tree in .sweep/s66/cur: bash callH.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/V
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
for qg in ${RUNS:-4bit:0 bf16:1 bf16:0}; do
  q=${qg%:*}; g=${qg#*:}
  t0=$(date +%s)
  (cd .sweep/s66/cur && PYTHONPATH=$PWD:/tmp/site MLX_USE_CUDA_GRAPHS=$g timeout ${PER:-180} python3 -m benchmarks.verify_forward --scale full --quant $q --context 4096 --kernels default,off --reps 5 --warmup 2 --device --device-forwards 6 --json $OUT/V/verify-$q-g$g.json > $OUT/V/verify-$q-g$g.txt 2>&1)
  echo "$q graphs=$g rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/V/verify-$q-g$g.txt | grep -v warn_once | tail -5 | cut -c1-300
done
