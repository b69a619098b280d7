#!/bin/bash
# Session 62: whole-loop processes (pacing_ab, our loop against mlx-lm's plain) by env arm.
# Usage: loop.sh "D C D C"
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/A
ROOT=$PWD
dir=$PWD/.sweep/s62/${TREE:-cur}
[ "${TREE:-cur}" = root ] && dir=$PWD
i=0
for arm in $1; do
  i=$((i+1))
  envs="DFLASH_S62=1"
  case $arm in
    G) envs="MLX_USE_CUDA_GRAPHS=0" ;;
    C) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_QMM_CLUSTER_SUM=1" ;;
    B) envs="MLX_MAX_MB_PER_BUFFER=100000" ;;
    N) envs="S62_GC=off" ;;
  esac
  f=$OUT/A/${TAG:-a}$i-$arm.txt
  t0=$(date +%s)
  (cd $dir && env PYTHONPATH=$dir:/tmp/site $envs timeout ${PER:-170} python3 $ROOT/.sweep/s62/gcwrap.py benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms 0 --reps 4 > $f 2>&1)
  echo "$i $arm rc=$? $(( $(date +%s)-t0 ))s $(grep -v Warning $f | grep -v '^GC' | tail -1 | cut -c1-260)"
  grep "^GC" $f
done
