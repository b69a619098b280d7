#!/bin/bash
# session 43, call B: the shipped merge (every split's load in flight) -- the matmul's `cuda` tests of every form, in
# parallel processes: default switches (scaled two-K-group, dense), every scaled kernel once, and with the scaled form
# off: two K groups, one K group, one K group with the folded offset; plus test_verify_kernels' `cuda` tests.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-B.txt 2>&1
P="python3 -m pytest -q -p no:cacheprovider"
Q=tests/test_tensor_qmm.py
timeout 530 $P $Q -m cuda -k "not every_scaled" > $OUT/B1-qmm-default.txt 2>&1 &
timeout 530 $P $Q -m cuda -k every_scaled > $OUT/B2-qmm-every-scaled.txt 2>&1 &
DFLASH_QMM_SCALED_B=0 timeout 530 $P $Q -m cuda -k "not scaled" > $OUT/B3-qmm-unscaled-k2.txt 2>&1 &
DFLASH_QMM_SCALED_B=0 DFLASH_QMM_TWO_K_GROUPS=0 timeout 530 $P $Q -m cuda -k "not scaled" > $OUT/B4-qmm-unscaled-k1.txt 2>&1 &
DFLASH_QMM_SCALED_B=0 DFLASH_QMM_TWO_K_GROUPS=0 DFLASH_QMM_FOLDED_OFFSET=1 timeout 530 $P $Q -m cuda -k "not scaled" > $OUT/B5-qmm-folded-k1.txt 2>&1 &
timeout 530 $P tests/test_verify_kernels.py -m cuda > $OUT/B6-verify-kernels.txt 2>&1 &
wait
for f in $OUT/B*.txt; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" $f | tail -4 | cut -c1-300; done
