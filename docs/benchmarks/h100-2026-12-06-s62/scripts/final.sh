#!/bin/bash
# Session 62, last lease: the cuda tests of the in-place reads (head prep at offsets, the
# gated fold's gate at an offset, the traced layers taking them), in parallel, then a
# loop pair on this tree (graphs off against on).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/T
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf tests/test_head_prep.py tests/test_fused_offsets.py -m cuda > $OUT/T/t1-heads-offsets.txt 2>&1 &
p1=$!
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf tests/test_traced_layers.py -m cuda > $OUT/T/t2-traced.txt 2>&1 &
p2=$!
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf tests/test_verify_kernels.py -m cuda -k fold > $OUT/T/t3-fold.txt 2>&1 &
p3=$!
wait $p1; echo "== t1 rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/T/t1-heads-offsets.txt | tail -6 | cut -c1-300
wait $p2; echo "== t2 rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/T/t2-traced.txt | tail -6 | cut -c1-300
wait $p3; echo "== t3 rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/T/t3-fold.txt | tail -6 | cut -c1-300
TREE=root PER=130 timeout ${LOOPT:-280} bash .sweep/s62/loop.sh "${LOOP:-G D}"
