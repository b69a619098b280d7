#!/bin/bash
# session 34, call 3: kernel texts compacted (default) against full (S34_FULL_TEXT=1), py-spy attached
# to the timed decodes; then the CUDA tests of the kernels the 4-bit verify launches.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
chmod +x .sweep/s34/py-spy
run() {  # name, env...
  name=$1; shift
  env SPY_OUT=$OUT/spy-$name.txt SPY_RATE=50 SPY_SECONDS=8 "$@" timeout 118 python3 .sweep/s34/spy_decode.py $OUT/spy-$name.json 6 > $OUT/spy-$name.log 2>&1
  echo "$name rc=$?"; grep -E "^setup|^summary|Error" $OUT/spy-$name.log | cut -c1-300 | head -5
  [ -s $OUT/spy-$name.txt ] && python3 .sweep/s34/fold_spy.py $OUT/spy-$name.txt > $OUT/fold-$name.txt && grep -E "samples|_Hash_bytes|eval_impl$|compile_replace$|CustomKernel::eval_gpu" $OUT/fold-$name.txt | head -12
}
run compact
run full S34_FULL_TEXT=1
mkdir -p $OUT/t
for f in tests/test_verify_kernels.py tests/test_head_prep.py tests/test_traced_layers.py; do
  timeout 40 python3 -m pytest -q -p no:cacheprovider $f -m cuda > $OUT/t/$(basename $f .py).txt 2>&1 &
done
wait
for f in $OUT/t/*.txt; do echo "== $(basename $f) $(grep -E 'passed|failed|error' $f | tail -1)"; grep -E "^(FAILED|ERROR)" $f | head -3 | cut -c1-200; done | tee $OUT/pytest-summary.txt
