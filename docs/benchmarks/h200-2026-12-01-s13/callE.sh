#!/bin/bash
# session 13, call E: the fused-projection tests on the GPU at K = 256, with the merged split sum
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
DFLASH_MERGED_SPLIT_SUM=1 timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_fused_projections.py --durations=5 > $OUT/pytest-fused-merged.txt 2>&1; echo pytest rc=$?
tail -12 $OUT/pytest-fused-merged.txt | cut -c1-300
