#!/bin/bash
# session 40, call D: the CUDA attention tests on the shipped texts (wide with two-float stores, the held fold), then the kernel patch's bitwise agreement.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/t
python3 -c "from dflash.metal import attention, tensor_attention as ta; print(ta.attend_spec(128, ta.WIDE).name('cuda'), attention.FOLD_CHUNKS.name('cuda'), attention.FOLD_GATED.name('cuda'))"
for f in tests/test_verify_kernels.py tests/test_tensor_attention.py tests/test_traced_layers.py; do
  timeout 330 python3 -m pytest -q -p no:cacheprovider $f -m cuda > $OUT/t/$(basename $f .py).txt 2>&1 &
done
wait
for f in $OUT/t/*.txt; do echo "== $(basename $f) $(grep -E 'passed|failed|error' $f | tail -1)"; grep -E "^(FAILED|ERROR)" $f | head -5 | cut -c1-250; done | tee $OUT/D-pytest-summary.txt
tar czf $OUT/D-pytest.tgz -C $OUT t && rm -r $OUT/t
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "plain_and_speculative_logits_agree_bitwise or compiled_forwards_give_the_uncompiled_bits or patched_forward_matches_mlx_attention or drafter_attention_matches" > $OUT/D-kernel-patch.txt 2>&1; echo kp rc=$?
tail -2 $OUT/D-kernel-patch.txt
