#!/bin/bash
# session 21, call F: head prep and residual norm launched through a compiled trace: cuda tests, host cost, the layer stack
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${T1:-150} python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_residual_norm.py tests/test_head_prep.py > $OUT/pytest-norm-prep-cuda.txt 2>&1; echo cuda rc=$?; tail -2 $OUT/pytest-norm-prep-cuda.txt; grep -E "^(FAILED|E  )" $OUT/pytest-norm-prep-cuda.txt | head -6 | cut -c1-300
timeout 60 python3 .sweep/s21/host_cost.py $OUT/host-cost.json > /dev/null 2>&1; echo host rc=$?; python3 -c "
import json, statistics, collections
d=json.load(open('$OUT/host-cost.json')); g=collections.defaultdict(list)
[g[r['arm']].append(r) for r in d]
for a, rs in g.items(): print(a, *[round(statistics.median(r[k] for r in rs),2) for k in ('build_us','encode_us','wall_us')])"
timeout ${T4:-200} python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms ours,ours-unresidual --forwards 20 --passes 2 --reps 4 --trace --json $OUT/stack-ab.json > $OUT/stack-ab.txt 2>&1; echo stack rc=$?; grep '^{' $OUT/stack-ab.txt | grep -v sequence | cut -c1-200
python3 -c "
import json; d=json.load(open('$OUT/stack-ab.json'))
for a,t in d['traces'].items(): print(a, t['kernels_per_layer'], t['busy_us_per_layer'], t['span_us_per_layer'])" 2>&1 | cut -c1-300
timeout ${T3:-100} python3 -m pytest -q -p no:cacheprovider -x tests/test_kernel_patch.py -k "agree_bitwise or near_ties or matches_mlx" > $OUT/pytest-kp-bitwise.txt 2>&1; echo kpb rc=$?; tail -2 $OUT/pytest-kp-bitwise.txt
