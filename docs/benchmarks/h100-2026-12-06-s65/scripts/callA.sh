#!/bin/bash
# Session 64 call A: the verify forward measured directly (benchmarks.verify_forward),
# 4-bit then bf16, our kernels (default) against mlx's own forward (off), graphs off.
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/V
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader; which ncu nsys; ls -d /usr/local/cuda*/bin 2>/dev/null
cd .sweep/s63/cur
export PYTHONPATH=$PWD:/tmp/site MLX_USE_CUDA_GRAPHS=0
for q in ${QUANTS:-4bit bf16}; do
  t0=$(date +%s)
  timeout ${PER:-240} python3 -m benchmarks.verify_forward --scale full --quant $q --context ${CTX:-4096} --kernels ${ARMS:-default,default-cluster,default-swiglu,off} --reps ${REPS:-5} --warmup 2 --device --device-forwards 6 --json $OUT/V/verify-$q-${CTX:-4096}.json > $OUT/V/verify-$q-${CTX:-4096}.txt 2>&1
  echo "$q rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/V/verify-$q-${CTX:-4096}.txt | tail -4 | cut -c1-300
done
