#!/bin/bash
# session 32, call D: the CUDA tests with packed launch scalars (every kernel test reads them), then the loop A/B with decode-only CUPTI.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/t
for f in tests/test_bucketed_keys.py tests/test_gated_mlp.py tests/test_head_prep.py tests/test_metal_cuda.py tests/test_residual_norm.py tests/test_tensor_attention.py tests/test_tensor_qmm.py tests/test_traced_layers.py tests/test_verify_kernels.py tests/test_wired_cache.py; do
  timeout 200 python3 -m pytest -q -p no:cacheprovider $f -m cuda > $OUT/t/$(basename $f .py).txt 2>&1 &
done
wait
for f in $OUT/t/*.txt; do echo "== $(basename $f) $(grep -E 'passed|failed|error' $f | tail -1)"; grep -E "^(FAILED|ERROR)" $f | head -3 | cut -c1-200; done | tee $OUT/D-pytest-summary.txt
tar czf $OUT/D-pytest.tgz -C $OUT t && rm -r $OUT/t
timeout 330 python3 .sweep/s32/loop_probe.py $OUT/D-loop.json 4bit > $OUT/D-loop.txt 2>&1; echo loop rc=$?
grep -E "^cupti|^\{'arm" $OUT/D-loop.txt | cut -c1-420
tail -30 $OUT/D-loop.txt | grep -E "decode_ms_median|tok_s|lossless|plain"
