#!/bin/bash
# Session 61, call 1: the cuda tests of what changed (merged heads into the head prep,
# one-node member views, the counters split, the drafter-shape head prep).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/T
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${T1:-150} python3 -m pytest -q -p no:cacheprovider -rf tests/test_head_prep.py -m cuda -k "merged or drafters" > $OUT/T/t1-heads.txt 2>&1
echo "== t1 rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/T/t1-heads.txt | tail -6 | cut -c1-300
timeout ${T2:-200} python3 -m pytest -q -p no:cacheprovider -rf tests/test_traced_layers.py -m cuda > $OUT/T/t2-traced.txt 2>&1
echo "== t2 rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/T/t2-traced.txt | tail -6 | cut -c1-300
timeout 60 python3 -m pytest -q -p no:cacheprovider -rf tests/test_graph_views.py > $OUT/T/t3-views.txt 2>&1
echo "== t3 rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/T/t3-views.txt | tail -4 | cut -c1-300
