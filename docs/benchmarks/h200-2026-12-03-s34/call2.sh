#!/bin/bash
# session 34, call 2: where the host's time goes in a 4-bit tau-6 decode: py-spy --native attached
# for the timed decodes only (50 Hz, 8 s), CUDA graphs on (default) and off.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
chmod +x .sweep/s34/py-spy
run() {  # name, env...
  name=$1; shift
  env SPY_OUT=$OUT/spy-$name.txt SPY_RATE=50 SPY_SECONDS=8 "$@" timeout 200 python3 .sweep/s34/spy_decode.py $OUT/spy-$name.json 6 > $OUT/spy-$name.log 2>&1
  echo "$name rc=$?"; grep -E "^setup|^summary|Error" $OUT/spy-$name.log | cut -c1-300 | head -5; tail -2 $OUT/spy-$name.txt.err
  [ -s $OUT/spy-$name.txt ] && python3 .sweep/s34/fold_spy.py $OUT/spy-$name.txt > $OUT/fold-$name.txt && sed -n 1,30p $OUT/fold-$name.txt | cut -c1-120
}
run default
run nographs MLX_USE_CUDA_GRAPHS=0
