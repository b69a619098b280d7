#!/bin/bash
# session 32, call E: the CUDA tests the packing touched (launch counts now with host-made scalars, the gather's own tests), and the 4-bit matmul tests.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/t
timeout 270 python3 -m pytest -q -p no:cacheprovider tests/test_metal_cuda.py -m cuda > $OUT/t/test_metal_cuda.txt 2>&1 &
timeout 270 python3 -m pytest -q -p no:cacheprovider tests/test_wired_cache.py -m cuda > $OUT/t/test_wired_cache.txt 2>&1 &
timeout 270 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -m cuda > $OUT/t/test_tensor_qmm.txt 2>&1 &
timeout 270 python3 -m pytest -q -p no:cacheprovider tests/test_launch_scalars.py > $OUT/t/test_launch_scalars.txt 2>&1 &
wait
for f in $OUT/t/*.txt; do echo "== $(basename $f) $(grep -E 'passed|failed|error' $f | tail -1)"; grep -E "^(FAILED|ERROR)|^E " $f | head -6 | cut -c1-200; done | tee $OUT/E-pytest-summary.txt
tar czf $OUT/E-pytest.tgz -C $OUT t && rm -r $OUT/t
