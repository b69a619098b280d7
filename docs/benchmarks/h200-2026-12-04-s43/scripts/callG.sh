#!/bin/bash
# session 43, call G: the loop again, the other order and twice each way (included, inline, included, inline).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
A="--scale full --quant 4bit --context 4096 --tokens 96 --arms 0 --reps 4"
for run in 1 2; do
  for inc in 1 0; do
    DFLASH_INCLUDED_TEXTS=$inc timeout 110 python3 -m benchmarks.pacing_ab $A --json $OUT/G-loop-inc$inc-run$run.json > $OUT/G-loop-inc$inc-run$run.txt 2>&1; echo loop inc=$inc run=$run rc=$?; grep summary $OUT/G-loop-inc$inc-run$run.txt | cut -c1-250
  done
done
