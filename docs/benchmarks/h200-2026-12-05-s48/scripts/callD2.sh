#!/bin/bash
# session 48, call D2: Nsight Compute of the shipped staged 4-bit form (fused gate+up 1 and 16 rows, o_proj 1 row):
# stall reasons per SASS line, memory throughput, issue rate.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/D2
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section SourceCounters --section WarpStateStats --section InstructionStats --section Occupancy --section LaunchStats --section SchedulerStats"
for shape in "6656 39936 1" "6656 39936 16" "4096 6656 1"; do
  f=$(echo $shape | tr ' ' '-')
  timeout 100 ncu $SECTIONS --kernel-name regex:tensor_q4 --launch-skip 2 --launch-count 1 -f -o $OUT/D2/ncu-$f python3 .sweep/s48/ncu_matmul.py $shape > $OUT/D2/ncu-$f.log 2>&1; echo ncu $f rc=$?
  ncu -i $OUT/D2/ncu-$f.ncu-rep --page details > $OUT/D2/ncu-$f-details.txt 2>&1
  ncu -i $OUT/D2/ncu-$f.ncu-rep --page source --csv --print-source sass > $OUT/D2/ncu-$f-sass.csv 2>&1; gzip $OUT/D2/ncu-$f-sass.csv
  rm -f $OUT/D2/ncu-$f.ncu-rep
  grep -E "Duration|DRAM Throughput|Issued Warp|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|Executed Instructions  |Grid Size|Block Size|Waves" $OUT/D2/ncu-$f-details.txt | head -12
done
cd $OUT && tar czf D2.tgz D2 && rm -rf D2
