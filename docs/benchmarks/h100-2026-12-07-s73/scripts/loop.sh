#!/bin/bash
# Session 72 adds D (today's defaults, no switch) and O (kernels off, graphs on).
# Session 66: whole-loop processes (pacing_ab: our loop against mlx-lm's plain decoding),
# graphs off; arms G (the default) and W (DFLASH_STACKED_KV=1). Usage: loop.sh "W G G W"
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/A
ROOT=$PWD
dir=$ROOT/.sweep/s66/cur
i=0
for arm in $1; do
  i=$((i+1))
  case $arm in
    G) envs="MLX_USE_CUDA_GRAPHS=0" ;;
    W) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_STACKED_KV=1" ;;
    N) envs="MLX_USE_CUDA_GRAPHS=1" ;;
    S) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_SWIGLU=1" ;;
    K) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_VERIFY_KERNELS=1" ;;
    M) envs="MLX_USE_CUDA_GRAPHS=1 DFLASH_VERIFY_KERNELS=1" ;;
    L) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_VERIFY_KERNELS=1 DFLASH_QMM_LEAN_BYTES=1" ;;
    P) envs="MLX_USE_CUDA_GRAPHS=1 DFLASH_VERIFY_KERNELS=1 DFLASH_QMM_LEAN_BYTES=1" ;;
    D) envs="DFLASH_UNSET=1" ;;
    O) envs="MLX_USE_CUDA_GRAPHS=1 DFLASH_VERIFY_KERNELS=0" ;;
  esac
  f=$OUT/A/a$i-$arm.txt
  t0=$(date +%s)
  (cd $dir && env PYTHONPATH=$dir:/tmp/site $envs timeout ${PER:-110} python3 $ROOT/.sweep/s66/gcwrap.py benchmarks.pacing_ab --scale full --quant ${QUANT:-4bit} --context ${CTX:-4096} --tokens 96 --arms 0 --reps 4 > $f 2>&1)
  echo "$i $arm rc=$? $(( $(date +%s)-t0 ))s $(grep -v Warning $f | grep -v '^GC' | tail -1 | cut -c1-260)"
done
