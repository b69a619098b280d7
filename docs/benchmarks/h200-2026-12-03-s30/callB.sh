#!/bin/bash
# session 30, call B: Nsight Compute of the pair layout and the row fold (16 and 1 queries over 4k), then the loop A/B.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
SECTIONS="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats"
for case in "4096 growing 16 8 pair 1" "4096 growing 16 8 stream 0" "4096 growing 1 8 pair 1" "4096 ring 16 8 pair 1"; do
  tag=$(echo $case | cut -d' ' -f1-3,5 | tr ' ' '-')
  timeout 60 ncu $SECTIONS --kernel-name regex:"attend_chunks|fold" --launch-skip 6 --launch-count 2 -f -o $OUT/B-ncu-$tag python3 .sweep/s30/ncu_attention.py $case > $OUT/B-ncu-$tag.log 2>&1; echo ncu $tag rc=$?
  ncu -i $OUT/B-ncu-$tag.ncu-rep --page details > $OUT/B-ncu-$tag-details.txt 2>&1
  grep -E "dflash|Duration|Elapsed Cycles|Registers Per|Achieved Occupancy|Grid Size|Block Size|Warp Cycles Per Issued" $OUT/B-ncu-$tag-details.txt | head -20 | cut -c1-200
done
timeout 280 python3 .sweep/s30/loop_probe.py $OUT/B-loop.json > $OUT/B-loop.txt 2>&1; echo loop rc=$?; tail -30 $OUT/B-loop.txt | cut -c1-300
