#!/bin/bash
# session 17, call B: CUPTI kernels of a 16-row decoder-layer stack (no cache), 4-bit and bf16, ours vs mlx: where the ~350 us a layer goes
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
for q in 4bit bf16; do
timeout ${P1:-150} python3 .sweep/s17/layer_compile.py --geometry full --quant $q --layers 8 --forwards 40 --passes 3 --reps 1 --arms mlx,ours --trace --json $OUT/layer-trace-$q.json > $OUT/layer-trace-$q.txt 2>&1; echo probe $q rc=$?
grep -v INFO $OUT/layer-trace-$q.txt | cut -c1-200
done
