#!/bin/bash
# session 19, call E: before (.sweep/prev = main at 98c5fd9) against after (this tree): the 4k verify layer stack with CUPTI, then whole rounds twice
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT
NEW=$PWD; PREV=$PWD/.sweep/prev
stack() { (cd $1 && PYTHONPATH=$1:/tmp/site timeout 110 python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms ours --forwards 20 --passes 3 --trace --json $OUT/stack-$2.json > $OUT/stack-$2.txt 2>&1); echo stack $2 rc=$?; grep '^{' $OUT/stack-$2.txt | grep -v sequence | cut -c1-200; }
stack $NEW new
rounds() { (cd $1 && PYTHONPATH=$1:/tmp/site timeout ${RT:-110} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 4 --kernels $3 --json $OUT/rp-$2.json > $OUT/rp-$2.txt 2>&1); echo rp $2 rc=$?; grep '^{' $OUT/rp-$2.txt | grep -v '"rounds"' | cut -c1-220; }
rounds $PREV prev1 default; rounds $NEW new1 default,default-interleaved
rounds $NEW new2 default-interleaved,default; rounds $PREV prev2 default
