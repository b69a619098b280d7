#!/bin/bash
# Session 60, call 3: whole-loop processes alternated by arm (the host-bound regime):
# D default; O the drafter's three opt-in parts; S the SwiGLU form. Usage: call3.sh "D O S D O S"
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/A
nvidia-smi --query-gpu=name --format=csv,noheader
i=0
for arm in $1; do
  i=$((i+1))
  case $arm in
    D) envs="" ;;
    O) envs="DFLASH_DRAFTER_FUSED_QKV=1 DFLASH_DRAFTER_HEAD_PREP=1 DFLASH_DRAFTER_TRACED=1" ;;
    S) envs="DFLASH_SWIGLU=1" ;;
  esac
  env $envs timeout ${PER:-150} python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms 0 --reps 4 --json $OUT/A/loop-$i-$arm.json > $OUT/A/loop-$i-$arm.txt 2>&1
  echo "$i $arm rc=$? $(grep -v Warning $OUT/A/loop-$i-$arm.txt | tail -1 | cut -c1-200)"
done
