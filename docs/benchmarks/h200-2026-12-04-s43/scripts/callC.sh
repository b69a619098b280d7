#!/bin/bash
# session 43, call C: the shipped merge -- the SwiGLU forms' `cuda` tests (scaled and unscaled, two and one K groups:
# the scaled one-K-group forms for the first time), the traced layers' and the kernel patch's bitwise agreement; then
# the merge's bits against the loop it replaced, over every form.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
P="python3 -m pytest -q -p no:cacheprovider"
G=tests/test_gated_mlp.py
timeout 400 $P $G -m cuda > $OUT/C1-swiglu-scaled-k2.txt 2>&1 &
DFLASH_QMM_TWO_K_GROUPS=0 timeout 400 $P $G -m cuda -k "not install_probe" > $OUT/C2-swiglu-scaled-k1.txt 2>&1 &
DFLASH_QMM_SCALED_B=0 timeout 400 $P $G -m cuda -k "not install_probe" > $OUT/C3-swiglu-unscaled-k2.txt 2>&1 &
DFLASH_QMM_SCALED_B=0 DFLASH_QMM_TWO_K_GROUPS=0 timeout 400 $P $G -m cuda -k "not install_probe" > $OUT/C4-swiglu-unscaled-k1.txt 2>&1 &
timeout 400 $P tests/test_kernel_patch.py -k "agree_bitwise or generators_install or near_ties or default_on_only or with_or_without" > $OUT/C5-kernel-patch.txt 2>&1 &
timeout 400 $P tests/test_traced_layers.py -m cuda > $OUT/C6-traced.txt 2>&1 &
timeout 400 python3 .sweep/s43/bits_merge.py > $OUT/C7-bits-merge.txt 2>&1 &
wait
for f in $OUT/C*.txt; do echo "== $f"; grep -E "^(FAILED|ERROR|DIFFERENT|MISMATCHES|scaled=)|passed|failed" $f | tail -6 | cut -c1-300; done
