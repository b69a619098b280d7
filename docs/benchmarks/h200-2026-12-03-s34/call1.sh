#!/bin/bash
# session 34, call 1: where the host's time goes in a 4-bit tau-6 decode (py-spy --native), default
# CUDA graphs, graphs off, and one large graph per forward.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
SPY=.sweep/s34/py-spy
chmod +x $SPY
lscpu | grep -E "Model name|MHz" > $OUT/cpu.txt
run() {  # name, env...
  name=$1; shift
  env "$@" timeout 175 $SPY record --native --idle --rate 400 --format raw -o $OUT/spy-$name.txt -- python3 .sweep/s34/spy_decode.py $OUT/spy-$name.json 6 > $OUT/spy-$name.log 2>&1
  echo "$name rc=$?"; grep -E "^summary|Error|error" $OUT/spy-$name.log | head -5
  [ -s $OUT/spy-$name.txt ] && python3 .sweep/s34/fold_spy.py $OUT/spy-$name.txt > $OUT/fold-$name.txt && head -45 $OUT/fold-$name.txt | cut -c1-140
}
run default
run nographs MLX_USE_CUDA_GRAPHS=0
run biggraph MLX_MAX_MB_PER_BUFFER=1000000 MLX_MAX_OPS_PER_BUFFER=2000
