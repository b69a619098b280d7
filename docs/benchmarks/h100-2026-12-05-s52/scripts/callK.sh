#!/bin/bash
# session 52, call K: the denormal decode's cuda tests in their default text (17-32 rows, groups of 32 / 128, one K
# group) and the in-place cases, with the kernel-patch and traced-layer cuda tests, in parallel processes.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/K
P="python3 -m pytest -q -p no:cacheprovider -rf"
Q=tests/test_tensor_qmm.py
timeout 250 $P $Q -m cuda -k "denormal or leading_shape" > $OUT/K/k1-denormal.txt 2>&1 &
timeout 250 $P $Q -m cuda -k tensor_matmul_glimmer_shapes > $OUT/K/k2-glimmer.txt 2>&1 &
DFLASH_QMM_TWO_K_GROUPS=0 timeout 250 $P $Q -m cuda -k "denormal" > $OUT/K/k3-denormal-k1.txt 2>&1 &
timeout 250 $P tests/test_kernel_patch.py -k "agree_bitwise or generators_install or near_ties or default_on_only or with_or_without" > $OUT/K/k4-kernel-patch.txt 2>&1 &
timeout 250 $P tests/test_traced_layers.py tests/test_verify_kernels.py -m cuda > $OUT/K/k5-traced-verify.txt 2>&1 &
wait
for f in $OUT/K/k*.txt; do echo "== $(basename $f)"; grep -E "^(FAILED|ERROR)|passed|failed|error" $f | tail -4 | cut -c1-300; done
cd $OUT && tar czf K.tgz K && rm -rf K
