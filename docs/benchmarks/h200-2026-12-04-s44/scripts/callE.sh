#!/bin/bash
# session 44, call E: the bf16 default as shipped (kernels on, no switch): the loop and our plain
# decoding against DFLASH_VERIFY_KERNELS=0; then 4-bit 4k pacing (taps, auto, an A/A copy), two processes.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/E
python3 -c "
from dflash.bench.scale_target import build_target
from dflash import kernel_patch
for quant in ('bf16', '4bit', '8bit'):
    print('default parts', quant, kernel_patch.wanted_parts(build_target('tiny', quant, 0)))
" 2>&1 | grep -v Warning
timeout 150 python3 -m benchmarks.plain_phases --scale full --quant bf16 --context 4096 --tokens 40 --passes 2 --kernels default,off --json $OUT/E/plain-bf16-default.json > $OUT/E/plain-bf16-default.txt 2>&1; echo plain rc=$?
grep '^{' $OUT/E/plain-bf16-default.txt | cut -c1-200
timeout 100 python3 -m benchmarks.pacing_ab --scale full --quant bf16 --context 4096 --tokens 96 --arms 0 --reps 3 --json $OUT/E/loop-bf16-default.json > $OUT/E/loop-bf16-default.txt 2>&1; echo loop bf16 default rc=$?; grep summary $OUT/E/loop-bf16-default.txt | cut -c1-300
for run in 1 2; do
  timeout 110 python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms 0,auto,0/b --reps 4 --json $OUT/E/pacing-run$run.json > $OUT/E/pacing-run$run.txt 2>&1; echo pacing run=$run rc=$?; grep summary $OUT/E/pacing-run$run.txt | cut -c1-400
done
cd $OUT && tar czf E.tgz E && rm -rf E
