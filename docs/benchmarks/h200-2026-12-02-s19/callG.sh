#!/bin/bash
# session 19, call G: the attention kernels reading queries (B, S, Hq, D): their cuda tests, then the layer's kernels
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${T1:-140} python3 -m pytest -q -p no:cacheprovider tests/test_tensor_attention.py tests/test_verify_kernels.py -k "cuda" > $OUT/pytest-attention-cuda-g.txt 2>&1; echo attn rc=$?; tail -2 $OUT/pytest-attention-cuda-g.txt
timeout ${T2:-60} python3 -m benchmarks.layer_stack --quant 4bit --layers 2 --context 4096 --arms ours --forwards 5 --passes 1 --trace --json $OUT/stack-g.json > $OUT/stack-g.txt 2>&1; echo stack rc=$?
python3 -c "
import json; d=json.load(open('$OUT/stack-g.json'))
for a,t in d['traces'].items(): print(a, t['kernels_per_layer'], t['busy_us_per_layer']); print(t['sequence'])" 2>&1 | cut -c1-1500
