#!/bin/bash
# session 18, call A2: the verify layers over a 4k context (our attention route included) with CUPTI, then rounds default vs two K groups
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${L1:-150} python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms mlx,ours --trace --json $OUT/layer-stack-4k.json > $OUT/layer-stack-4k.txt 2>&1; echo stack rc=$?
grep -v INFO $OUT/layer-stack-4k.txt | cut -c1-300 | head -30
timeout ${R1:-230} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 3 --kernels default,default-kgroups2 --json $OUT/rp-4bit-4k-k2.json > $OUT/rp-4bit-4k-k2.txt 2>&1; echo rp rc=$?
grep "^{" $OUT/rp-4bit-4k-k2.txt | grep -v '"rounds"' | cut -c1-240
tail -3 $OUT/rp-4bit-4k-k2.txt
