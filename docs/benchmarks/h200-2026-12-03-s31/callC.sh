#!/bin/bash
# session 31, call C: the chunk pass and fold with reused vs fresh host-written parameter arrays; kernel vs application replay.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT /tmp/C
P=.sweep/s31/params_probe.py
M="--metrics gpc__cycles_elapsed.max,sm__cycles_active.avg,smsp__inst_executed.sum,launch__grid_size,launch__block_size,launch__registers_per_thread"
{
for replay in kernel application; do
  for mode in reuse fresh; do
    tag=$replay-$mode
    timeout 100 ncu $M --replay-mode $replay --cache-control none --kernel-name regex:"attend_chunks|fold" --launch-skip 4 --launch-count 8 -f -o /tmp/C/$tag python3 $P $mode 8 > /tmp/C/$tag.log 2>&1
    echo "== $tag rc=$?"; grep -E "^mode|rror" /tmp/C/$tag.log | head -3
    ncu -i /tmp/C/$tag.ncu-rep --page raw --csv 2>/dev/null | python3 .sweep/s31/ncu_table.py
  done
done
timeout 120 python3 $P both 3 timed
} 2>&1 | tee $OUT/C-summary.txt
