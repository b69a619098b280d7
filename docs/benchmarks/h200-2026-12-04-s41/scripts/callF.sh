#!/bin/bash
# session 41, call F: with the wave rule's fixed cost at 4 chunks: the CUDA matmul tests on Glimmer's shapes and the merged split sum, and the kernel patch's bitwise agreement.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/t
python3 -c "from dflash.metal import tensor_qmm as t; print(t.CTA_OVERHEAD_CHUNKS, t.split_plan(6656, 39936, 4), t.SCALED_SPECS[(2,(4,1),64)].name('cuda'))"
timeout 270 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -m cuda -k "glimmer_shapes or merged_split_sum or batch_invariant" > $OUT/t/test_tensor_qmm.txt 2>&1 &
timeout 270 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "plain_and_speculative_logits_agree_bitwise or compiled_forwards_give_the_uncompiled_bits" > $OUT/t/test_kernel_patch.txt 2>&1 &
wait
for f in $OUT/t/*.txt; do echo "== $(basename $f) $(grep -E 'passed|failed|error' $f | tail -1)"; grep -E "^(FAILED|ERROR)" $f | head -5 | cut -c1-250; done | tee $OUT/F-pytest-summary.txt
tar czf $OUT/F-pytest.tgz -C $OUT t && rm -r $OUT/t
