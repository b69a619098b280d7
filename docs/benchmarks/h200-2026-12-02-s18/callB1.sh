#!/bin/bash
# session 18, call B1: the GPU tests of this session's changes: the matmul (two K groups by default, counters
# cut from a pool), the attention kernels, and the patched route (plane halves and held-back blocks as views).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt 2>&1
timeout ${T1:-110} python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -k "cuda or counter" > $OUT/pytest-tensor-qmm.txt 2>&1; echo qmm rc=$?; tail -2 $OUT/pytest-tensor-qmm.txt
timeout ${T2:-110} python3 -m pytest -q -p no:cacheprovider tests/test_tensor_attention.py tests/test_verify_kernels.py -k "cuda or shipped" > $OUT/pytest-attention.txt 2>&1; echo attn rc=$?; tail -2 $OUT/pytest-attention.txt
timeout ${T3:-170} python3 -m pytest -q -p no:cacheprovider -x tests/test_kernel_patch.py tests/test_fused_projections.py > $OUT/pytest-route.txt 2>&1; echo route rc=$?; tail -2 $OUT/pytest-route.txt
