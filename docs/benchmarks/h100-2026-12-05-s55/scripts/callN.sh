#!/bin/bash
# session 55, call N: ncu of the 16-row fused gate+up, the default (chunk-major) against interleaved scales.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/N
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section SourceCounters --section InstructionStats --section Occupancy"
for v in current interleaved; do
  timeout 60 /usr/local/cuda/bin/ncu $SECTIONS --kernel-name regex:tensor_q4 --launch-skip 2 --launch-count 1 -f -o $OUT/N/ncu-$v python3 .sweep/s55/ncu_variant.py $v 6656 39936 16 > $OUT/N/ncu-$v.log 2>&1; echo ncu $v rc=$?
  /usr/local/cuda/bin/ncu -i $OUT/N/ncu-$v.ncu-rep --page details > $OUT/N/ncu-$v-details.txt 2>&1
  rm -f $OUT/N/ncu-$v.ncu-rep
  grep -E "Duration|DRAM Throughput|L1/TEX Hit|Mem Pipes Busy|Issued Warp|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|Executed Instructions  |uncoalesced|excessive" $OUT/N/ncu-$v-details.txt | head -14 | cut -c1-220
done
