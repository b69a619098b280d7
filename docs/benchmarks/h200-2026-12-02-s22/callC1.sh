#!/bin/bash
# session 22, call C1: the stacked block with the lean fetch: layer stack A/B (bits, kernels, host), rounds A/B
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${T1:-120} python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms ours,ours-unstacked --forwards 16 --passes 2 --reps 5 --trace --json $OUT/stack-lean.json > $OUT/stack-lean.txt 2>&1; echo stack rc=$?; grep '^{' $OUT/stack-lean.txt | grep -v sequence | cut -c1-220
python3 -c "
import json; d=json.load(open('$OUT/stack-lean.json'))
for a,t in d['traces'].items(): print(a, t['kernels_per_layer'], t['busy_us_per_layer'], t['span_us_per_layer'])" 2>&1 | cut -c1-500
timeout ${T2:-150} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 4 --kernels default,default-unstacked --json $OUT/rp-stacked.json > $OUT/rp-stacked.txt 2>&1; echo rp rc=$?; grep '^{' $OUT/rp-stacked.txt | grep -v '"rounds"' | cut -c1-260
