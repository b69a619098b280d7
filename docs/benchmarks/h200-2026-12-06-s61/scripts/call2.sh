#!/bin/bash
# Session 61, call 2: whole-loop processes alternated by tree: N this session's tree
# (one-node views, counters split), O session 60's (HEAD 16ea865), S N with DFLASH_SWIGLU=1.
# Usage: call2.sh "N O N O"
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/A
ROOT=$PWD
i=0
for arm in $1; do
  i=$((i+1))
  envs=""; dir=$ROOT
  case $arm in
    O) dir=$ROOT/.sweep/s61/old ;;
    S) envs="DFLASH_SWIGLU=1" ;;
  esac
  (cd $dir && env PYTHONPATH=$dir:/tmp/site $envs timeout ${PER:-150} python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms 0 --reps 4 --json $OUT/A/loop-${TAG:-a}$i-$arm.json > $OUT/A/loop-${TAG:-a}$i-$arm.txt 2>&1)
  echo "$i $arm rc=$? $(grep -v Warning $OUT/A/loop-${TAG:-a}$i-$arm.txt | tail -1 | cut -c1-220)"
done
