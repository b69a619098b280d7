#!/bin/bash
# session 26, call B2: Nsight Compute of the fused gate+up call (16 rows), current and scaled-weight forms:
# per-SASS-instruction stall samples (source page), instruction mix, pipe use.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
which cuobjdump nvdisasm ncu > $OUT/B2-tools.txt 2>&1
for f in current scaled; do cuobjdump -sass .sweep/s26/$f.cubin > $OUT/B2-sass-$f.txt 2>&1; done
SECTIONS="--section SpeedOfLight --section SourceCounters --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats"
for f in current scaled; do
  flag=0; [ $f = scaled ] && flag=1
  DFLASH_QMM_SCALED_B=$flag timeout 130 ncu $SECTIONS --kernel-name regex:tensor_q4 --launch-skip 2 --launch-count 1 -f -o $OUT/B2-ncu-$f python3 .sweep/s26/ncu_matmul.py 6656 39936 16 > $OUT/B2-ncu-$f.log 2>&1; echo ncu $f rc=$?
  ncu -i $OUT/B2-ncu-$f.ncu-rep --page details > $OUT/B2-ncu-$f-details.txt 2>&1
  ncu -i $OUT/B2-ncu-$f.ncu-rep --page source --csv --print-source sass > $OUT/B2-ncu-$f-sass.csv 2>&1; echo src rc=$?
  grep -E "Duration|Executed Ipc A|Issued Warp|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|Executed Instructions  " $OUT/B2-ncu-$f-details.txt | head -12
done
ls -la $OUT
