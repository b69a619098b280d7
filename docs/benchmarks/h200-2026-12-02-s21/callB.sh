#!/bin/bash
# session 21, call B: residual norms on the GPU (kernel bits vs mlx, model-level bitwise), the verify layer's kernels with and without
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${T1:-150} python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_residual_norm.py > $OUT/pytest-residual-norm-cuda.txt 2>&1; echo rn rc=$?; tail -3 $OUT/pytest-residual-norm-cuda.txt; grep -E "^(FAILED|E  )" $OUT/pytest-residual-norm-cuda.txt | head -8 | cut -c1-300
timeout ${T2:-150} python3 -m pytest -q -p no:cacheprovider tests/test_residual_layers.py tests/test_prepared_heads.py > $OUT/pytest-residual-layers.txt 2>&1; echo rl rc=$?; tail -3 $OUT/pytest-residual-layers.txt; grep -E "^(FAILED|E  )" $OUT/pytest-residual-layers.txt | head -8 | cut -c1-300
timeout ${T3:-120} python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "agree_bitwise or near_ties or matches_mlx" > $OUT/pytest-kp-bitwise.txt 2>&1; echo kpb rc=$?; tail -2 $OUT/pytest-kp-bitwise.txt; grep -E "^(FAILED|E  )" $OUT/pytest-kp-bitwise.txt | head -8 | cut -c1-300
timeout ${T4:-200} python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms ours,ours-unresidual --forwards 20 --passes 2 --reps 4 --trace --json $OUT/stack-ab.json > $OUT/stack-ab.txt 2>&1; echo stack rc=$?; grep '^{' $OUT/stack-ab.txt | grep -v sequence | cut -c1-200
python3 -c "
import json; d=json.load(open('$OUT/stack-ab.json'))
for a,t in d['traces'].items(): print(a, t['kernels_per_layer'], t['busy_us_per_layer'], t['span_us_per_layer']); print(t['sequence'][:20]); [print(x) for x in t['top'][:8]]" 2>&1 | cut -c1-400
