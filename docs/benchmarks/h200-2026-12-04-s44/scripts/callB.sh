#!/bin/bash
# session 44, call B: 4-bit at 32k with the default (taps) and every 4; bf16 at 32k with the kernels
# on and off; then 4-bit 4k pacing arms with an A/A control.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/B
timeout 160 python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 32768 --tokens 96 --arms 0,4 --reps 3 --json $OUT/B/loop32k.json > $OUT/B/loop32k.txt 2>&1; echo loop32k rc=$?; grep summary $OUT/B/loop32k.txt | cut -c1-300
for vk in 1 0; do
  DFLASH_VERIFY_KERNELS=$vk timeout 130 python3 -m benchmarks.pacing_ab --scale full --quant bf16 --context 32768 --tokens 96 --arms 0 --reps 3 --json $OUT/B/loop32k-bf16-vk$vk.json > $OUT/B/loop32k-bf16-vk$vk.txt 2>&1; echo loop32k bf16 vk=$vk rc=$?; grep summary $OUT/B/loop32k-bf16-vk$vk.txt | cut -c1-300
done
timeout 130 python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms 0,4,auto,0/b --reps 4 --json $OUT/B/pacing.json > $OUT/B/pacing.txt 2>&1; echo pacing rc=$?; grep -E "summary" $OUT/B/pacing.txt | cut -c1-400
cd $OUT && tar czf B.tgz B && rm -rf B
