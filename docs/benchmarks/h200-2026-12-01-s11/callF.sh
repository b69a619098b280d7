#!/bin/bash
# session 11, call F: the kernel patch's tests on the GPU (the bound forwards with the CUDA kernels)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -c "import mlx.core as mx; print(mx.default_device(), mx.cuda.is_available())"
timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_kernel_patch.py > $OUT/pytest-kernel-patch-gpu.txt 2>&1; echo rc=$?
tail -15 $OUT/pytest-kernel-patch-gpu.txt
