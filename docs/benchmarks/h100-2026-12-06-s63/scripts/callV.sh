#!/bin/bash
# Session 63's one call: on an H200, the copy probe (the weights read by each copy form,
# never run on an H200) and the shipped 4-bit matmul on the same shapes, weights cold;
# then the verify forward's device time measured directly (benchmarks.verify_forward,
# new), 4-bit then bf16, our kernels (default) against mlx's own forward (off).
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/V
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
cd .sweep/s63/cur
export PYTHONPATH=$PWD:/tmp/site MLX_USE_CUDA_GRAPHS=0
S="mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused"
if [[ $gpu == *H200* ]]; then
  t0=$(date +%s)
  timeout 150 python3 -m benchmarks.copy_probe --shapes "$S" --forms stream,cpasync-tile,tma-tile,bulk-slab --cold-bytes 268435456 --json $OUT/V/copy-h200.json > $OUT/V/copy-h200.txt 2>&1
  echo "copy rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/V/copy-h200.txt | tail -20 | cut -c1-200
  t0=$(date +%s)
  timeout 150 python3 -m benchmarks.matmul_variants --variants current --rows 1,16 --shapes "$S" --cold-bytes 268435456 --json $OUT/V/qmm-h200.json > $OUT/V/qmm-h200.txt 2>&1
  echo "qmm rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/V/qmm-h200.txt | tail -12 | cut -c1-200
fi
for q in ${QUANTS:-4bit bf16}; do
  t0=$(date +%s)
  timeout ${PER:-240} python3 -m benchmarks.verify_forward --scale full --quant $q --context 4096 --kernels default,off --reps ${REPS:-5} --warmup 2 --device --device-forwards 6 --json $OUT/V/verify-$q.json > $OUT/V/verify-$q.txt 2>&1
  echo "$q rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/V/verify-$q.txt | tail -4 | cut -c1-300
done
