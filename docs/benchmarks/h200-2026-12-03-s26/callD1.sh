#!/bin/bash
# session 26, call D1: the scaled-weight form (now the default, with its launch bounds) against the unscaled
# one at 4 and 8 bits, same run; the CUDA tests of the matmul.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TORCHPY=/opt/torch/.venv/bin/python3
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-D.txt 2>&1
S4="mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj"
show() { grep "^{" $1 | python3 -c "import sys,json; [print(r['projection'][:14], r['rows'], r['variant'], r['device_us'], r['over_bound'], r['max_abs_diff_vs_mlx']) for r in map(json.loads, sys.stdin)]"; }
timeout 100 $TORCHPY -m benchmarks.matmul_variants --bits 8 --rows 16,1 --variants unscaled,current --shapes "$S4" --json $OUT/D-8bit.json > $OUT/D-8bit.txt 2>&1; echo 8bit rc=$?
show $OUT/D-8bit.txt
timeout 100 $TORCHPY -m benchmarks.matmul_variants --rows 16,1,32 --variants unscaled,current --shapes "$S4" --json $OUT/D-4bit.json > $OUT/D-4bit.txt 2>&1; echo 4bit rc=$?
show $OUT/D-4bit.txt
timeout 330 python3 -m pytest -q -p no:cacheprovider -x tests/test_tensor_qmm.py tests/test_verify_kernels.py -m cuda > $OUT/D-pytest-matmul-cuda.txt 2>&1; echo pytest rc=$?
tail -5 $OUT/D-pytest-matmul-cuda.txt
