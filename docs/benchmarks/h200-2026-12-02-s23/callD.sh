#!/bin/bash
# session 23, call D: the SwiGLU form (silu(gate) * up in the fused gate / up launch): cuda tests, layer stack A/B (bits, kernels)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${T1:-100} python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_gated_mlp.py > $OUT/pytest-gated-mlp-cuda.txt 2>&1; echo gm rc=$?; tail -2 $OUT/pytest-gated-mlp-cuda.txt; grep -E "^(FAILED|E  )" $OUT/pytest-gated-mlp-cuda.txt | head -6 | cut -c1-300
timeout ${T2:-110} python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms ours,ours-swiglu --forwards 16 --passes 2 --reps 3 --trace --json $OUT/stack-swiglu.json > $OUT/stack-swiglu.txt 2>&1; echo stack rc=$?; grep '^{' $OUT/stack-swiglu.txt | grep -v sequence | cut -c1-220
python3 -c "
import json; d=json.load(open('$OUT/stack-swiglu.json'))
for a,t in d['traces'].items(): print(a, t['kernels_per_layer'], t['busy_us_per_layer'], t['span_us_per_layer']); print(t['sequence'][:16]); print([(x['name'][40:95], x['us_per_layer']) for x in t['top'][:4]])" 2>&1 | cut -c1-1800
