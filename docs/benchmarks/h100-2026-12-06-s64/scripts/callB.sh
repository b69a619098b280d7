#!/bin/bash
# Session 64 call B: the copy probe (weights read by each copy form) and the shipped 4-bit
# matmul on the same shapes, weights cold.
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/V
cd .sweep/s63/cur
export PYTHONPATH=$PWD:/tmp/site MLX_USE_CUDA_GRAPHS=0
S="mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused"
t0=$(date +%s)
timeout 170 python3 -m benchmarks.copy_probe --shapes "$S" --forms stream,ldg-tile,cpasync-tile,bulk-tile,bulk-slab,tma-tile --cold-bytes 268435456 --json $OUT/V/copy.json > $OUT/V/copy.txt 2>&1
echo "copy rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/V/copy.txt | tail -20 | cut -c1-200
t0=$(date +%s)
timeout ${QPER:-260} python3 -m benchmarks.matmul_variants --variants ${VARS:-current,memonly,computeonly,contig,cluster} --rows 1,16 --shapes "$S" --cold-bytes 268435456 --json $OUT/V/qmm.json > $OUT/V/qmm.txt 2>&1
echo "qmm rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/V/qmm.txt | tail -45 | cut -c1-200
