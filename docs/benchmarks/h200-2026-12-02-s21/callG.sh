#!/bin/bash
# session 21, call G: Glimmer's output gate in the fold's epilogue: cuda tests (mlx's sigmoid and multiply bits), model-level bits, the layer's kernels
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${T1:-80} python3 -m pytest -q -p no:cacheprovider tests/test_verify_kernels.py -k "cuda_gated" > $OUT/pytest-gated-fold-cuda.txt 2>&1; echo gf rc=$?; tail -2 $OUT/pytest-gated-fold-cuda.txt; grep -E "^(FAILED|E  )" $OUT/pytest-gated-fold-cuda.txt | head -6 | cut -c1-300
timeout ${T2:-60} python3 -m pytest -q -p no:cacheprovider tests/test_prepared_heads.py -k "hand_the_gate or gives_mlx_lms_bits" > $OUT/pytest-gate-model.txt 2>&1; echo gm rc=$?; tail -2 $OUT/pytest-gate-model.txt; grep -E "^(FAILED|E  )" $OUT/pytest-gate-model.txt | head -6 | cut -c1-300
timeout ${T3:-110} python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms ours,ours-ungated --forwards 16 --passes 2 --reps 3 --trace --json $OUT/stack-gate.json > $OUT/stack-gate.txt 2>&1; echo stack rc=$?; grep '^{' $OUT/stack-gate.txt | grep -v sequence | cut -c1-200
python3 -c "
import json; d=json.load(open('$OUT/stack-gate.json'))
for a,t in d['traces'].items(): print(a, t['kernels_per_layer'], t['busy_us_per_layer'], t['span_us_per_layer']); print(t['sequence'][:19])" 2>&1 | cut -c1-1500
