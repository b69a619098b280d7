#!/bin/bash
# session 40, call C: old vs new attention texts (CUPTI, one process), then the CUDA attention tests on the new texts.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/t
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-C.txt 2>&1
timeout 240 python3 .sweep/s40/wide_ab.py $OUT/C-ab.json 4 30 > $OUT/C-ab.txt 2>&1; echo ab rc=$?
grep -E "^sm_count|^case|^median|rror" $OUT/C-ab.txt | cut -c1-420
for f in tests/test_verify_kernels.py tests/test_tensor_attention.py; do
  timeout 300 python3 -m pytest -q -p no:cacheprovider $f -m cuda > $OUT/t/$(basename $f .py).txt 2>&1 &
done
wait
for f in $OUT/t/*.txt; do echo "== $(basename $f) $(grep -E 'passed|failed|error' $f | tail -1)"; grep -E "^(FAILED|ERROR)" $f | head -5 | cut -c1-250; done | tee $OUT/C-pytest-summary.txt
tar czf $OUT/C-pytest.tgz -C $OUT t && rm -r $OUT/t
