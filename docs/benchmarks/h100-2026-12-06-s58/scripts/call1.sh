#!/bin/bash
# Session 58, call 1: the residual norm with shuffle trees and early epsilons (cuda
# tests, device time against mlx's ops), and the traced layers with it (cuda tests).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/A $OUT/B
P="python3 -m pytest -q -p no:cacheprovider -rf"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 $P tests/test_residual_norm.py -m cuda > $OUT/A/a1-residual-norm.txt 2>&1
echo "== a1"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/A/a1-residual-norm.txt | tail -4 | cut -c1-300
timeout 80 python3 -m benchmarks.norm_cost --rows 1,16 --json $OUT/B/norm-cost.json > $OUT/B/norm-cost.txt 2>&1; echo "norm_cost rc=$?"
head -c 2500 $OUT/B/norm-cost.txt
timeout 120 $P tests/test_traced_layers.py -m cuda -k "residual or glimmers_width" > $OUT/A/a2-traced-residual.txt 2>&1
echo "== a2"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/A/a2-traced-residual.txt | tail -4 | cut -c1-300
