#!/bin/bash
# session 14, call C: the kernel patch's tests (bitwise plain-vs-speculative included) with the split sum and the fold merged
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
DFLASH_MERGED_SPLIT_SUM=1 DFLASH_MERGED_FOLD=1 timeout ${T1:-250} python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "bitwise or matches_mlx or matmul_only" > $OUT/pytest-patch-fold.txt 2>&1; echo pytest rc=$?
tail -4 $OUT/pytest-patch-fold.txt | cut -c1-300
DFLASH_MERGED_SPLIT_SUM=1 DFLASH_MERGED_FOLD=1 timeout ${T2:-220} python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "not (bitwise or matches_mlx or matmul_only)" > $OUT/pytest-patch-rest-fold.txt 2>&1; echo pytest rc=$?
tail -4 $OUT/pytest-patch-rest-fold.txt | cut -c1-300
