#!/bin/bash
# session 26, call C: __launch_bounds__ on the matmul (two CTAs an SM for the scaled-weight form, three with a
# 70 KB ring), against the current form, same run.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TORCHPY=/opt/torch/.venv/bin/python3
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-C.txt 2>&1
S4="mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj"
show() { grep "^{" $1 | python3 -c "import sys,json; [print(r['projection'][:14], r['rows'], r['variant'], r['device_us'], r['over_bound'], r['max_abs_diff_vs_mlx']) for r in map(json.loads, sys.stdin)]"; }
timeout 240 $TORCHPY -m benchmarks.matmul_variants --rows 16,1 --variants current,lb2,scaled-lb2,budget70k-lb3,scaled-budget70k-lb3 --shapes "$S4" --json $OUT/C-bounds.json > $OUT/C-bounds.txt 2>&1; echo bounds rc=$?
show $OUT/C-bounds.txt
timeout 100 $TORCHPY -m benchmarks.matmul_variants --rows 32 --variants current,scaled,scaled-lb2 --shapes "$S4" --json $OUT/C-bounds32.json > $OUT/C-bounds32.txt 2>&1; echo bounds32 rc=$?
show $OUT/C-bounds32.txt
