#!/bin/bash
# session 49, call E: the matmul's `cuda` tests with the session-49 switches as given in the environment
# (DFLASH_QMM_DENORMAL_Q4=1, and DFLASH_QMM_PAIRED_STAGE / DFLASH_QMM_LEAN_ISSUE as call D decided), in parallel
# processes.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DFLASH_QMM_DENORMAL_Q4=1
echo "paired=${DFLASH_QMM_PAIRED_STAGE:-unset} lean=${DFLASH_QMM_LEAN_ISSUE:-unset} denormal=$DFLASH_QMM_DENORMAL_Q4"
mkdir -p $OUT/E
P="python3 -m pytest -q -p no:cacheprovider -rf"
Q=tests/test_tensor_qmm.py
T=${T:-370}
timeout $T $P $Q -m cuda -k tensor_matmul_glimmer_shapes > $OUT/E/e1-qmm-glimmer.txt 2>&1 &
timeout $T $P $Q -m cuda -k every_scaled_kernel > $OUT/E/e2-qmm-every-scaled.txt 2>&1 &
timeout $T $P $Q -m cuda -k "scaled_form_glimmer_shapes or rounded_weight or both_kernel_forms" > $OUT/E/e3-qmm-scaled.txt 2>&1 &
timeout $T $P $Q -m cuda -k "denormal or leading_shape" > $OUT/E/e4-qmm-denormal.txt 2>&1 &
timeout $T $P $Q -m cuda -k "member_major or merged_split_sum or batch_invariant or matches_oracle or unaligned" > $OUT/E/e5-qmm-rest.txt 2>&1 &
timeout $T $P tests/test_gated_mlp.py -m cuda > $OUT/E/e6-gated.txt 2>&1 &
timeout $T $P tests/test_verify_kernels.py tests/test_tensor_cluster.py -m cuda > $OUT/E/e7-verify-cluster.txt 2>&1 &
timeout $T $P tests/test_traced_layers.py tests/test_wired_cache.py -m cuda > $OUT/E/e8-traced-wired.txt 2>&1 &
timeout $T $P tests/test_kernel_patch.py -k "agree_bitwise or generators_install or near_ties or default_on_only or with_or_without" > $OUT/E/e9-kernel-patch.txt 2>&1 &
wait
for f in $OUT/E/e*.txt; do echo "== $(basename $f)"; grep -E "^(FAILED|ERROR)|passed|failed|error" $f | tail -4 | cut -c1-300; done
cd $OUT && tar czf E.tgz E && rm -rf E
