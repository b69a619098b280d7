#!/bin/bash
# Session 61, call 4 (a second lease): the traced layers' and the head prep's cuda tests
# with the counter pool cut ahead (regions eight at a time).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/T
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${T2:-200} python3 -m pytest -q -p no:cacheprovider -rf tests/test_traced_layers.py tests/test_graph_views.py -m "cuda or not cuda" -k "cuda or pool or feed or nodes" > $OUT/T/t4-traced-pool.txt 2>&1
echo "== t4 rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/T/t4-traced-pool.txt | tail -6 | cut -c1-300
