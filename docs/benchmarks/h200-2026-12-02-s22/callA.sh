#!/bin/bash
# session 22, call A: the gated-fold probe on CUDA; compiled MLP blocks over a 4k context (layer stack); side by side with the gate epilogue (4-bit 4k tau 6)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 60 python3 -c "
import mlx.core as mx
from dflash import prepared_heads as p
for d in (mx.bfloat16, mx.float16, mx.float32):
    print('gated_fold_matches', d, p.gated_fold_matches(d, None), p.gated_fold_matches(d, True))
" > $OUT/probe.txt 2>&1; echo probe rc=$?; cat $OUT/probe.txt | tail -4
timeout ${T2:-150} python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms ours,ours-blocked --forwards 16 --passes 2 --reps 4 --trace --json $OUT/stack-blocked.json > $OUT/stack-blocked.txt 2>&1; echo stack rc=$?; grep '^{' $OUT/stack-blocked.txt | grep -v sequence | cut -c1-220
python3 -c "
import json; d=json.load(open('$OUT/stack-blocked.json'))
for a,t in d['traces'].items(): print(a, t['kernels_per_layer'], t['busy_us_per_layer'], t['span_us_per_layer']); print(t['sequence'][:22])" 2>&1 | cut -c1-1500
timeout ${SB:-330} python3 -m benchmarks.side_by_side --out $OUT/sbs --peer-src $PWD/.sweep/peer -- --scale full --quant 4bit --context 4096 --max-tokens 96 --replay-tau 6 --passes 2 > $OUT/sbs.txt 2>&1; echo sbs rc=$?; tail -12 $OUT/sbs.txt | cut -c1-250
