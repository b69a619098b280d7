#!/bin/bash
# For the next lease (written in session 52, not yet run): the paired stage and the lean issue beside the pairs in
# place (the default since session 52; that text has run only on the emulator). Their cuda tests first, then per
# call with the weights cold (current = in place; paired-lean; shifted = the pairs shifted, session 51's default).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/P
P="python3 -m pytest -q -p no:cacheprovider -rf"
Q=tests/test_tensor_qmm.py
SW="DFLASH_QMM_PAIRED_STAGE=1 DFLASH_QMM_LEAN_ISSUE=1"
env $SW timeout 250 $P $Q -m cuda -k "denormal or leading_shape" > $OUT/P/p1-denormal.txt 2>&1 &
env $SW timeout 250 $P $Q -m cuda -k tensor_matmul_glimmer_shapes > $OUT/P/p2-glimmer.txt 2>&1 &
env $SW timeout 250 $P tests/test_kernel_patch.py -k "agree_bitwise" > $OUT/P/p3-kernel-patch.txt 2>&1 &
wait
for f in $OUT/P/p*.txt; do echo "== $(basename $f)"; grep -E "^(FAILED|ERROR)|passed|failed|error" $f | tail -4 | cut -c1-300; done
S="mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused;lm_head"
timeout 250 python3 -m benchmarks.matmul_variants --variants current,paired-lean,shifted --rows 1,16,32 --shapes "$S" --cold-bytes 268435456 --json $OUT/P/q4-cold.json > $OUT/P/q4-cold.txt 2>&1; echo q4 rc=$?
cd $OUT && tar czf P.tgz P && rm -rf P
