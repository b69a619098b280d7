#!/bin/bash
# session 13, call C: the kernel patch's bitwise plain-vs-speculative tests with the merged split sum; the fused-test probe
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
DFLASH_MERGED_SPLIT_SUM=1 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "bitwise or matches_mlx or matmul_only" > $OUT/pytest-patch-merged.txt 2>&1; echo pytest rc=$?
tail -4 $OUT/pytest-patch-merged.txt
timeout 200 python3 .sweep/s13/fused_probe2.py mixed 200 > $OUT/fused-probe2.txt 2>&1; echo probe rc=$?
cut -c1-500 $OUT/fused-probe2.txt | grep -v '"done"' | tail -12; tail -1 $OUT/fused-probe2.txt
