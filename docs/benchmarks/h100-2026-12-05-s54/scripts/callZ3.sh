#!/bin/bash
# session 54, call Z3: chunk-major scales as the default (no switch set): the matmul's wider cuda tests, SwiGLU's,
# and plain = DFlash bits through the traced layers and the kernel patch.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/Z3
P="python3 -m pytest -q -p no:cacheprovider -rf"
Q=tests/test_tensor_qmm.py
timeout 215 $P $Q -m cuda -k "every_scaled_kernel or scaled_form or merged_split_sum or member_major or unaligned or batch_invariant or matches_oracle" > $OUT/Z3/z1-matmul.txt 2>&1 &
(timeout 95 $P tests/test_gated_mlp.py -m cuda > $OUT/Z3/z2-swiglu.txt 2>&1; timeout 115 $P $Q -m cuda -k "denormal or leading_shape or glimmer" > $OUT/Z3/z3-denormal.txt 2>&1) &
timeout 215 $P tests/test_traced_layers.py tests/test_kernel_patch.py -k "cuda or agree_bitwise" > $OUT/Z3/z4-plain-dflash.txt 2>&1 &
wait
for f in $OUT/Z3/z*.txt; do echo "== $(basename $f)"; grep -E "^(FAILED|ERROR)|passed|failed|error|Timeout|Terminated" $f | tail -5 | cut -c1-300; done

