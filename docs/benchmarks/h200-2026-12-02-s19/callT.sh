#!/bin/bash
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 130 python3 -m benchmarks.layer_stack --quant 4bit --layers 4 --context 4096 --arms mlx,ours --forwards 10 --passes 2 --trace --json $OUT/stack-4k-seq.json > $OUT/stack-4k-seq.txt 2>&1; echo stack4k rc=$?; grep '^{' $OUT/stack-4k-seq.txt | cut -c1-200
timeout 170 python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 32768 --arms mlx,ours --forwards 10 --passes 2 --trace --json $OUT/stack-32k.json > $OUT/stack-32k.txt 2>&1; echo stack32k rc=$?; grep '^{' $OUT/stack-32k.txt | cut -c1-200
