#!/bin/bash
# session 35, call 1: CUDA tests of what the views change touches (also compiles the kernels into
# the PTX cache), then the 4-bit A/B: this tree (new), the tree before (old, .sweep/s35/old), new again.
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/t
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
lscpu | grep -E "Model name|^CPU\(s\)" >> $OUT/gpu.txt
run_tests() {
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_traced_layers.py -m cuda > $OUT/t/traced_layers.txt 2>&1 &
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -m cuda -k "leading or member_major or glimmer" > $OUT/t/tensor_qmm.txt 2>&1 &
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_verify_kernels.py -m cuda -k "merged or gated" > $OUT/t/verify_kernels.txt 2>&1 &
  wait
}
run_tests
for f in $OUT/t/*.txt; do echo "== $(basename $f) $(grep -E 'passed|failed|error' $f | tail -1)"; grep -E "^(FAILED|ERROR)" $f | head -3 | cut -c1-200; done | tee $OUT/pytest-summary.txt
arm() {  # name tree
  PYTHONPATH=$2:/tmp/site timeout 130 python3 .sweep/s35/ab.py $OUT/ab-$1.json 4bit $1 > $OUT/ab-$1.txt 2>&1
  echo "$1 rc=$?"; grep -E "^setup|^summary|Error" $OUT/ab-$1.txt | cut -c1-200
}
arm new1 $PWD
arm old1 $PWD/.sweep/s35/old
arm new2 $PWD
tar czf $OUT/tests.tgz -C $OUT t && rm -r $OUT/t
