#!/bin/bash
# Session 56, call 8: with DFLASH_QMM_INTERLEAVED_SCALES=1 for every process (as the
# flipped default), the other cuda tests of the modules that launch the matmul.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DFLASH_QMM_INTERLEAVED_SCALES=1
mkdir -p $OUT/A
P="python3 -m pytest -q -p no:cacheprovider -rf"
K="not (denormal or leading_shape or tensor_matmul_glimmer_shapes or every_scaled_kernel or scaled_form_matches)"
timeout 450 $P tests/test_tensor_qmm.py -m cuda -k "$K" > $OUT/A/a6-qmm-rest.txt 2>&1 &
timeout 450 $P tests/test_verify_kernels.py -m cuda > $OUT/A/a7-verify.txt 2>&1 &
timeout 450 $P tests/test_gated_mlp.py tests/test_fused_projections.py -m cuda > $OUT/A/a8-mlp-fused.txt 2>&1 &
timeout 450 $P tests/test_lossless.py tests/test_layer_stack.py -m cuda > $OUT/A/a9-lossless.txt 2>&1 &
wait
for f in $OUT/A/a*.txt; do echo "== $(basename $f)"; grep -E "^(FAILED|ERROR)|passed|failed|error" $f | tail -4 | cut -c1-300; done
