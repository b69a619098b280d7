#!/bin/bash
# session 13, call F: every CUDA matmul test and the rest of the kernel-patch tests with the merged split sum on
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
DFLASH_MERGED_SPLIT_SUM=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -m cuda > $OUT/pytest-cuda-qmm-merged-env.txt 2>&1; echo pytest rc=$?
tail -2 $OUT/pytest-cuda-qmm-merged-env.txt
DFLASH_MERGED_SPLIT_SUM=1 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "not (bitwise or matches_mlx or matmul_only)" > $OUT/pytest-patch-rest-merged.txt 2>&1; echo pytest rc=$?
tail -4 $OUT/pytest-patch-rest-merged.txt | cut -c1-300
