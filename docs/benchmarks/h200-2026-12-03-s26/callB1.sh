#!/bin/bash
# session 26, call B1: the scaled-weight form against the current one (device time per call, 1/16/32 rows,
# 4- and 8-bit), the copies-alone / arithmetic-alone diagnostics of both, and the CUDA tests of the form.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TORCHPY=/opt/torch/.venv/bin/python3
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu.txt 2>&1
S4="mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj"
show() { grep "^{" $1 | python3 -c "import sys,json; [print(r['projection'][:14], r['rows'], r['variant'], r['device_us'], r['over_bound'], r['max_abs_diff_vs_mlx']) for r in map(json.loads, sys.stdin)]"; }
timeout 200 $TORCHPY -m benchmarks.matmul_variants --rows 16 --variants current,scaled,computeonly,scaled-computeonly,memonly,memonly-nox --shapes "$S4" --json $OUT/B1-variants16.json > $OUT/B1-variants16.txt 2>&1; echo mv16 rc=$?
show $OUT/B1-variants16.txt
timeout 90 $TORCHPY -m benchmarks.matmul_variants --rows 1,32 --variants current,scaled --shapes "$S4" --json $OUT/B1-variants1-32.json > $OUT/B1-variants1-32.txt 2>&1; echo mv1-32 rc=$?
show $OUT/B1-variants1-32.txt
timeout 80 $TORCHPY -m benchmarks.matmul_variants --bits 8 --rows 16 --variants current,scaled --shapes "$S4" --json $OUT/B1-variants16-8bit.json > $OUT/B1-variants16-8bit.txt 2>&1; echo mv8 rc=$?
show $OUT/B1-variants16-8bit.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -k "cuda_scaled or scaled_weight_switch" > $OUT/B1-pytest-scaled.txt 2>&1; echo pytest rc=$?
tail -5 $OUT/B1-pytest-scaled.txt
