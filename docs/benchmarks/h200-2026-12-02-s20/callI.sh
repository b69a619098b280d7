#!/bin/bash
# session 20, call I: the opt-in matmul forms (one K group; folded offset) through their cuda tests
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
DFLASH_QMM_TWO_K_GROUPS=0 timeout ${T1:-200} python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -k cuda > $OUT/pytest-qmm-one-k-group.txt 2>&1; echo onek rc=$?; tail -2 $OUT/pytest-qmm-one-k-group.txt
DFLASH_QMM_FOLDED_OFFSET=1 timeout ${T2:-200} python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -k cuda > $OUT/pytest-qmm-folded-offset.txt 2>&1; echo fold rc=$?; tail -2 $OUT/pytest-qmm-folded-offset.txt
