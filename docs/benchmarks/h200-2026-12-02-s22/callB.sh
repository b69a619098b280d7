#!/bin/bash
# session 22, call B: head prep writes the stacked K/V block; cuda tests, layer stack A/B (bits, kernels), side by side (lossless end to end), a profile of the build on this host
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${T1:-90} python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_head_prep.py > $OUT/pytest-head-prep-cuda.txt 2>&1; echo hp rc=$?; tail -2 $OUT/pytest-head-prep-cuda.txt; grep -E "^(FAILED|E  )" $OUT/pytest-head-prep-cuda.txt | head -6 | cut -c1-300
timeout ${T2:-130} python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms ours,ours-unstacked --forwards 16 --passes 2 --reps 4 --trace --json $OUT/stack-stacked.json > $OUT/stack-stacked.txt 2>&1; echo stack rc=$?; grep '^{' $OUT/stack-stacked.txt | grep -v sequence | cut -c1-220
python3 -c "
import json; d=json.load(open('$OUT/stack-stacked.json'))
for a,t in d['traces'].items(): print(a, t['kernels_per_layer'], t['busy_us_per_layer'], t['span_us_per_layer']); print(t['sequence'][:18])" 2>&1 | cut -c1-1500
timeout ${T3:-60} python3 .sweep/s22/profile_build.py ours > $OUT/profile-build.txt 2>&1; echo prof rc=$?; head -3 $OUT/profile-build.txt
timeout ${SB:-200} python3 -m benchmarks.side_by_side --out $OUT/sbs --peer-src $PWD/.sweep/peer -- --scale full --quant 4bit --context 4096 --max-tokens 96 --replay-tau 6 --passes 2 > $OUT/sbs.txt 2>&1; echo sbs rc=$?; tail -4 $OUT/sbs.txt | cut -c1-250
