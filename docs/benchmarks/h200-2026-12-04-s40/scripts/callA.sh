#!/bin/bash
# session 40, call A: the fold held against its loops (CUPTI, one process), then Nsight Compute: the chunk pass's and both folds' stalls by SASS line.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT /tmp/A
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-A.txt 2>&1
timeout 200 python3 .sweep/s40/fold_ab.py $OUT/A-fold.json 4 30 > $OUT/A-fold.txt 2>&1; echo fold rc=$?
grep -E "^case|^median|rror" $OUT/A-fold.txt | cut -c1-330
S="--section SourceCounters --section WarpStateStats --section LaunchStats --section Occupancy --section SpeedOfLight"
for arm in held loops; do
  timeout 100 ncu $S --kernel-name regex:"attend_chunks|fold" --launch-skip 4 --launch-count 2 -f -o /tmp/A/src-$arm python3 .sweep/s40/ncu_probe.py 4096 growing 16 $arm 5 > /tmp/A/src-$arm.log 2>&1; echo ncu $arm rc=$?
  tail -1 /tmp/A/src-$arm.log
  ncu -i /tmp/A/src-$arm.ncu-rep --page details > $OUT/A-details-$arm.txt 2>&1
  grep -E "custom_kernel|Elapsed Cycles|Duration|Registers Per|Warp Cycles Per Issued|Executed Instructions  |Achieved Occupancy|Theoretical Occupancy" $OUT/A-details-$arm.txt | sed 's/  */ /g' | cut -c1-150
  ncu -i /tmp/A/src-$arm.ncu-rep --page source --csv --print-source sass > /tmp/A/src-$arm.csv 2>&1; echo csv rc=$?
done
# The source page holds both kernels: split by kernel where the CSV says so, else summarise whole.
python3 - <<'PY'
import csv, os
for arm in ("held", "loops"):
    path = f"/tmp/A/src-{arm}.csv"
    lines = open(path).read().splitlines()
    print(arm, "lines", len(lines), [l[:120] for l in lines if "Kernel" in l or "custom_kernel" in l][:6])
PY
gzip -c /tmp/A/src-held.csv > $OUT/A-src-held.csv.gz; gzip -c /tmp/A/src-loops.csv > $OUT/A-src-loops.csv.gz
ls -la $OUT
