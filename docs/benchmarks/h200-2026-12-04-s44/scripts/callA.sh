#!/bin/bash
# session 44, call A: bf16 with the texts included. Our plain decoding per kernel arm (the question
# that keeps bf16's default off), then the loop with the kernels off (the bf16 default) and on, two
# processes each way, alternating.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/A
timeout 200 python3 -m benchmarks.plain_phases --scale full --quant bf16 --context 4096 --tokens 40 --passes 3 --kernels off,all,attention --json $OUT/A/plain-bf16.json > $OUT/A/plain-bf16.txt 2>&1; echo plain rc=$?
grep -v Warning $OUT/A/plain-bf16.txt | tail -14 | cut -c1-300
A="--scale full --quant bf16 --context 4096 --tokens 96 --arms 0,4 --reps 4"
for run in 1 2; do
  for vk in 0 1; do
    DFLASH_VERIFY_KERNELS=$vk timeout 150 python3 -m benchmarks.pacing_ab $A --json $OUT/A/loop-vk$vk-run$run.json > $OUT/A/loop-vk$vk-run$run.txt 2>&1; echo loop vk=$vk run=$run rc=$?; grep summary $OUT/A/loop-vk$vk-run$run.txt | cut -c1-300
  done
done
cd $OUT && tar czf A.tgz A && rm -rf A
