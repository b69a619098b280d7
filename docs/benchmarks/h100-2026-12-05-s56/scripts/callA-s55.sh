#!/bin/bash
# For the next lease (written in session 55, not yet run): interleaved scales' cuda tests
# (DFLASH_QMM_INTERLEAVED_SCALES=1 for the whole process). Session 55's call A could not
# collect tests/test_tensor_qmm.py under the switch (fixed since; tests/test_switch_collection.py).
# If every test passes, flip INTERLEAVED_SCALES_DEFAULT and run callB.sh.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/A
P="python3 -m pytest -q -p no:cacheprovider -rf"
Q=tests/test_tensor_qmm.py
E="env DFLASH_QMM_INTERLEAVED_SCALES=1"
$E timeout 250 $P $Q -m cuda -k "denormal or leading_shape" > $OUT/A/a1-denormal.txt 2>&1 &
$E timeout 250 $P $Q -m cuda -k tensor_matmul_glimmer_shapes > $OUT/A/a2-glimmer.txt 2>&1 &
$E timeout 250 $P $Q -m cuda -k "every_scaled_kernel or scaled_form_matches" > $OUT/A/a3-scaled.txt 2>&1 &
$E timeout 250 $P tests/test_kernel_patch.py -k "agree_bitwise" > $OUT/A/a4-kernel-patch.txt 2>&1 &
$E timeout 250 $P tests/test_traced_layers.py -m cuda > $OUT/A/a5-traced.txt 2>&1 &
wait
for f in $OUT/A/a*.txt; do echo "== $(basename $f)"; grep -E "^(FAILED|ERROR)|passed|failed|error" $f | tail -4 | cut -c1-300; done
