#!/bin/bash
# session 51, call F: the matmul's opt-in forms' `cuda` tests (unscaled B, folded offset, one K group, unscaled
# SwiGLU) with the vector merge and the session-51 defaults (denormal, paired, lean) on, in parallel processes.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DFLASH_QMM_DENORMAL_Q4=1 DFLASH_QMM_PAIRED_STAGE=1 DFLASH_QMM_LEAN_ISSUE=1 DFLASH_QMM_VECTOR_MERGE=1
mkdir -p $OUT/F
P="python3 -m pytest -q -p no:cacheprovider -rf"
Q=tests/test_tensor_qmm.py
T=${T:-400}
DFLASH_QMM_SCALED_B=0 timeout $T $P $Q -m cuda -k tensor_matmul_glimmer_shapes > $OUT/F/f1-unscaled-glimmer.txt 2>&1 &
DFLASH_QMM_SCALED_B=0 timeout $T $P $Q -m cuda -k "member_major or merged_split_sum or batch_invariant or matches_oracle or unaligned" > $OUT/F/f2-unscaled-rest.txt 2>&1 &
DFLASH_QMM_SCALED_B=0 timeout $T $P tests/test_gated_mlp.py -m cuda > $OUT/F/f3-unscaled-gated.txt 2>&1 &
DFLASH_QMM_SCALED_B=0 DFLASH_QMM_FOLDED_OFFSET=1 timeout $T $P $Q -m cuda -k tensor_matmul_glimmer_shapes > $OUT/F/f4-folded-glimmer.txt 2>&1 &
DFLASH_QMM_SCALED_B=0 DFLASH_QMM_FOLDED_OFFSET=1 timeout $T $P $Q -m cuda -k "member_major or merged_split_sum or batch_invariant or matches_oracle or unaligned" > $OUT/F/f5-folded-rest.txt 2>&1 &
DFLASH_QMM_TWO_K_GROUPS=0 timeout $T $P $Q -m cuda -k tensor_matmul_glimmer_shapes > $OUT/F/f6-k1-glimmer.txt 2>&1 &
DFLASH_QMM_TWO_K_GROUPS=0 timeout $T $P $Q -m cuda -k "member_major or merged_split_sum or batch_invariant or matches_oracle or unaligned" > $OUT/F/f7-k1-rest.txt 2>&1 &
DFLASH_QMM_TWO_K_GROUPS=0 timeout $T $P tests/test_gated_mlp.py -m cuda > $OUT/F/f8-k1-gated.txt 2>&1 &
wait
for f in $OUT/F/f*.txt; do echo "== $(basename $f)"; grep -E "^(FAILED|ERROR)|passed|failed|error" $f | tail -4 | cut -c1-300; done
cd $OUT && tar czf F.tgz F && rm -rf F
