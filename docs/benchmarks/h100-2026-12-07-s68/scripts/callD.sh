#!/bin/bash
# Session 65's call D with session 68's seven probe forms: the copy probe (weights cold),
# then the verify forward's arms at 4-bit and bf16 (graphs off), in one call.
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/V
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
cd .sweep/s66/cur
export PYTHONPATH=$PWD:/tmp/site MLX_USE_CUDA_GRAPHS=0
S="mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused"
t0=$(date +%s)
timeout ${CPER:-150} python3 -m benchmarks.copy_probe --shapes "$S" --forms stream,ldg-tile,cpasync-tile,cpasync-slab,bulk-tile,bulk-slab,tma-tile --cold-bytes 268435456 --json $OUT/V/copy.json > $OUT/V/copy.txt 2>&1
echo "copy rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/V/copy.txt | tail -12 | cut -c1-200
for q in ${QUANTS:-4bit bf16}; do
  t0=$(date +%s)
  timeout ${PER:-200} python3 -m benchmarks.verify_forward --scale full --quant $q --context 4096 --kernels ${ARMS:-default,default-uncluster,default-swiglu,off} --reps 5 --warmup 2 --device --device-forwards 6 --json $OUT/V/verify-$q-4096.json > $OUT/V/verify-$q-4096.txt 2>&1
  echo "$q rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/V/verify-$q-4096.txt | tail -6 | cut -c1-300
done
