#!/bin/bash
# session 29, call E: Nsight Compute of the 16-query attention call (chunk pass and fold), 4k growing and the ring.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
SECTIONS="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis"
for case in "4096 growing 16" "4096 ring 16" "4096 growing 1"; do
  tag=$(echo $case | tr ' ' '-')
  timeout 150 ncu $SECTIONS --kernel-name regex:"attend_chunks|fold" --launch-skip 6 --launch-count 2 -f -o $OUT/E-ncu-$tag python3 .sweep/s29/ncu_attention.py $case 8 > $OUT/E-ncu-$tag.log 2>&1; echo ncu $tag rc=$?
  ncu -i $OUT/E-ncu-$tag.ncu-rep --page details > $OUT/E-ncu-$tag-details.txt 2>&1
  grep -E "dflash|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Grid Size|Block Size|Issued Warp|Warp Cycles Per Issued|No Eligible|Dynamic Shared" $OUT/E-ncu-$tag-details.txt | head -30
done
