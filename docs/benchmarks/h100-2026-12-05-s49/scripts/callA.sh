#!/bin/bash
# session 49, call A: every `cuda` test with both session-48 switches on (DFLASH_QMM_VECTOR_MERGE=1,
# DFLASH_QMM_DENORMAL_Q4=1), in parallel processes, plus the kernel patch's bitwise plain / DFlash tests.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DFLASH_QMM_VECTOR_MERGE=1 DFLASH_QMM_DENORMAL_Q4=1
mkdir -p $OUT/A
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
P="python3 -m pytest -q -p no:cacheprovider -rf"
Q=tests/test_tensor_qmm.py
T=470
timeout $T $P $Q -m cuda -k tensor_matmul_glimmer_shapes > $OUT/A/a1-qmm-glimmer.txt 2>&1 &
timeout $T $P $Q -m cuda -k every_scaled_kernel > $OUT/A/a2-qmm-every-scaled.txt 2>&1 &
timeout $T $P $Q -m cuda -k "scaled_form_glimmer_shapes or rounded_weight or both_kernel_forms" > $OUT/A/a3-qmm-scaled.txt 2>&1 &
timeout $T $P $Q -m cuda -k "denormal or leading_shape" > $OUT/A/a4-qmm-denormal.txt 2>&1 &
timeout $T $P $Q -m cuda -k "member_major or merged_split_sum or batch_invariant or matches_oracle or unaligned" > $OUT/A/a5-qmm-rest.txt 2>&1 &
timeout $T $P tests/test_gated_mlp.py tests/test_tensor_cluster.py tests/test_tensor_direct.py -m cuda > $OUT/A/a6-gated-cluster-direct.txt 2>&1 &
timeout $T $P tests/test_verify_kernels.py tests/test_tensor_attention.py -m cuda > $OUT/A/a7-verify-attention.txt 2>&1 &
timeout $T $P tests/test_traced_layers.py tests/test_wired_cache.py tests/test_head_prep.py tests/test_residual_norm.py tests/test_launch_scalars.py -m cuda > $OUT/A/a8-traced-wired-heads.txt 2>&1 &
timeout $T $P tests/test_kernel_patch.py -k "agree_bitwise or generators_install or near_ties or default_on_only or with_or_without" > $OUT/A/a9-kernel-patch.txt 2>&1 &
timeout $T $P tests/test_layer_stack.py tests/test_metal_cuda.py -m cuda > $OUT/A/a10-stack-metal.txt 2>&1 &
wait
for f in $OUT/A/a*.txt; do echo "== $(basename $f)"; grep -E "^(FAILED|ERROR)|passed|failed|error" $f | tail -4 | cut -c1-300; done
cd $OUT && tar czf A.tgz A && rm -rf A
