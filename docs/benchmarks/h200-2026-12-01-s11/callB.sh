#!/bin/bash
# session 11, call B: host phases of plain decoding before (959fd8d) and after the bound forwards, then DFlash rounds A/B (4-bit, 4k)
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT
NEW=$PWD
git worktree add -q /tmp/old 959fd8d 2>&1 | tail -1; cp $NEW/benchmarks/plain_phases.py /tmp/old/benchmarks/
git log --oneline -1 > $OUT/commit.txt
P="--scale full --quant 4bit --context 4096 --tokens 40 --passes 2 --kernels off,attention,matmul,all"
for tree in new old; do
  dir=$NEW; [ $tree = old ] && dir=/tmp/old
  (cd $dir && PYTHONPATH=$dir:/tmp/site timeout 150 python3 -m benchmarks.plain_phases $P --json $OUT/plain-phases-$tree.json > $OUT/plain-phases-$tree.txt 2>&1; echo $tree rc=$?)
  grep '"arm"' $OUT/plain-phases-$tree.txt | grep -v extra | cut -c1-170
done
cd $NEW && PYTHONPATH=$NEW:/tmp/site timeout 240 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 3 --plain-time --kernels off,all --json $OUT/rp-ab3-4bit-4k.json > $OUT/rp-ab3-4bit.txt 2>&1; echo rp rc=$?
grep '"runs"\|ms_per_token' $OUT/rp-ab3-4bit.txt | cut -c1-250
