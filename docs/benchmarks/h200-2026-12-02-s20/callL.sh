#!/bin/bash
# session 20, call L: head prep on against off in one process (alternating, 4 reps), 4-bit verify layers over 4k, CUPTI on the first rep
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${T1:-170} python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms ours,ours-unprepared --forwards 20 --passes 2 --reps 4 --trace --json $OUT/stack-ab.json > $OUT/stack-ab.txt 2>&1; echo stack rc=$?; grep '^{' $OUT/stack-ab.txt | grep -v sequence | cut -c1-200
python3 -c "
import json; d=json.load(open('$OUT/stack-ab.json'))
for a,t in d['traces'].items(): print(a, t['kernels_per_layer'], t['busy_us_per_layer'], t['span_us_per_layer'])"
