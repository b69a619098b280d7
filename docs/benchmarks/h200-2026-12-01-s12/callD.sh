#!/bin/bash
# session 12, call D: the kernel patch's and fused projections' tests on the GPU (TF32 off, new matmul issue path)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 520 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py tests/test_fused_projections.py --durations=8 > $OUT/pytest-patch-fused-gpu.txt 2>&1; echo rc=$?
tail -22 $OUT/pytest-patch-fused-gpu.txt
