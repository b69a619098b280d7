#!/bin/bash
# session 31, call A: the wide chunk pass split into loads and arithmetic, and three candidate edits, under Nsight Compute.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT /tmp/A
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > /tmp/A/gpu-A.txt 2>&1
V=.sweep/s31/attn_variants.py
for v in base unroll kfirst kfirst_unroll; do
  for c in "4096 growing 16" "4096 ring 16" "4096 growing 1"; do
    timeout 60 python3 $V $c 2 $v check 2>&1 | grep -E "same_bits|Error|error" | head -3
  done
done > $OUT/A-same-bits.txt
cat $OUT/A-same-bits.txt
SECTIONS="--section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --section InstructionStats"
for c in "4096 growing 16" "4096 growing 1" "4096 ring 16"; do
  for v in base loadonly computeonly unroll kfirst kfirst_unroll; do
    tag=$(echo $c | tr ' ' '-')-$v
    timeout 60 ncu $SECTIONS --kernel-name regex:"attend_chunks" --launch-skip 3 --launch-count 1 -f -o /tmp/A/ncu-$tag python3 $V $c 5 $v > /tmp/A/ncu-$tag.log 2>&1
    ncu -i /tmp/A/ncu-$tag.ncu-rep --page details > /tmp/A/ncu-$tag-details.txt 2>&1
    printf "%-28s " $tag; grep -E "Elapsed Cycles|SM Active Cycles|Registers Per|Warp Cycles Per Issued|Executed Instructions  " /tmp/A/ncu-$tag-details.txt | awk '{print $NF}' | tr '\n' ' '; echo
  done
done | tee $OUT/A-ncu-summary.txt
# Per-instruction view of the shipped text (stall sampling by SASS line).
timeout 90 ncu --section SourceCounters --section WarpStateStats --kernel-name regex:"attend_chunks" --launch-skip 3 --launch-count 1 -f -o /tmp/A/src-base python3 $V 4096 growing 16 5 base > /tmp/A/src-base.log 2>&1; echo src rc=$?
ncu -i /tmp/A/src-base.ncu-rep --page source --csv --print-source sass > /tmp/A/src-base-sass.csv 2>&1; echo csv rc=$?
gzip -c /tmp/A/src-base-sass.csv > $OUT/A-src-base-sass.csv.gz
ncu -i /tmp/A/src-base.ncu-rep --page details > /tmp/A/src-base-details.txt 2>&1
tar czf $OUT/A-details.tgz -C /tmp/A $(cd /tmp/A && ls *-details.txt gpu-A.txt *.log)
ls -la $OUT
