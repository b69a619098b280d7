#!/bin/bash
# session 18, call B2: before (.sweep/old = main at 0ceb6e7) against after (this tree), same call:
# the 4k verify layer stack with CUPTI, then whole rounds (old default / new default / new default-kgroups1), twice.
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT
NEW=$PWD; OLD=$PWD/.sweep/old
stack() { (cd $1 && PYTHONPATH=$1:/tmp/site timeout 120 python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms ours --trace --json $OUT/stack-$2.json > $OUT/stack-$2.txt 2>&1); echo stack $2 rc=$?; grep '^{' $OUT/stack-$2.txt | cut -c1-200; }
stack $OLD old; stack $NEW new
rounds() { (cd $1 && PYTHONPATH=$1:/tmp/site timeout 150 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 5 --kernels $3 --json $OUT/rp-$2.json > $OUT/rp-$2.txt 2>&1); echo rp $2 rc=$?; grep '^{' $OUT/rp-$2.txt | grep -v '"rounds"' | cut -c1-220; }
rounds $OLD old1 default; rounds $NEW new1 default,default-kgroups1
rounds $OLD old2 default; rounds $NEW new2 default-kgroups1,default
# where the host's round goes now (cProfile, own time)
(cd $NEW && PYTHONPATH=$NEW:/tmp/site timeout 120 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 1 --kernels default --profile 30 --json $OUT/rp-new-profile.json > $OUT/rp-new-profile.txt 2>&1); echo profile rc=$?
