#!/bin/bash
# Session 63: whole-loop processes (pacing_ab: our loop against mlx-lm's plain decoding).
# Usage: loop.sh "G:cur D:cur ..." (arms as in rounds.sh)
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/A
ROOT=$PWD
i=0
for spec in $1; do
  i=$((i+1))
  arm=${spec%%:*}; tree=cur; [[ $spec == *:* ]] && tree=${spec#*:}
  dir=$ROOT/.sweep/s63/$tree
  case $arm in
    G) envs="MLX_USE_CUDA_GRAPHS=0" ;;
    D) envs="MLX_USE_CUDA_GRAPHS=1" ;;
    S) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_SWIGLU=1" ;;
    P) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_EVAL_EVERY=4" ;;
    C) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_QMM_CLUSTER_SUM=1" ;;
    U) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_QMM_CLUSTER_SUM=0" ;;
    R) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_DRAFTER_FUSED_QKV=1 DFLASH_DRAFTER_HEAD_PREP=1 DFLASH_DRAFTER_TRACED=1" ;;
  esac
  f=$OUT/A/${TAG:-a}$i-$arm-$tree.txt
  t0=$(date +%s)
  (cd $dir && env PYTHONPATH=$dir:/tmp/site $envs timeout ${PER:-170} python3 $ROOT/.sweep/s63/gcwrap.py benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms 0 --reps 4 > $f 2>&1)
  echo "$i $arm $tree rc=$? $(( $(date +%s)-t0 ))s $(grep -v Warning $f | grep -v '^GC' | tail -1 | cut -c1-260)"
done
