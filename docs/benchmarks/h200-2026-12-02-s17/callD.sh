#!/bin/bash
# session 17, call D (call B again, each traced forward alone): CUPTI kernels of a 16-row decoder-layer stack (no cache), 4-bit and bf16, ours vs mlx: where the ~350 us a layer goes
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
for q in 4bit bf16; do
timeout ${P1:-150} python3 .sweep/s17/layer_compile.py --geometry full --quant $q --layers 8 --reps 1 --arms mlx,ours --trace --forwards 20 --passes 2 --json $OUT/layer-seqtrace-$q.json > $OUT/layer-seqtrace-$q.txt 2>&1; echo probe $q rc=$?
grep -v INFO $OUT/layer-seqtrace-$q.txt | cut -c1-200
done
