#!/bin/bash
# session 25, call A: the 4-bit matmul's copies alone / arithmetic alone / a tile-contiguous layout / L2 prefetch hints, per projection; ncu of the fused gate+up
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TORCHPY=/opt/torch/.venv/bin/python3
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu.txt 2>&1
S4="mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj"
timeout ${T1:-240} $TORCHPY -m benchmarks.matmul_variants --rows 16 --variants current,memonly,computeonly,contig,memonly-contig,prefetch256,memonly-prefetch256,prefetch128 --shapes "$S4" --json $OUT/A-variants16.json > $OUT/A-variants16.txt 2>&1; echo mv16 rc=$?
grep "^{" $OUT/A-variants16.txt | python3 -c "import sys,json; [print(r['projection'][:14], r['rows'], r['variant'], r['device_us'], r['over_bound']) for r in map(json.loads, sys.stdin)]"
timeout ${T2:-150} $TORCHPY -m benchmarks.matmul_variants --rows 1 --variants current,contig,prefetch256,prefetch128 --shapes "$S4" --json $OUT/A-variants1.json > $OUT/A-variants1.txt 2>&1; echo mv1 rc=$?
grep "^{" $OUT/A-variants1.txt | python3 -c "import sys,json; [print(r['projection'][:14], r['rows'], r['variant'], r['device_us'], r['over_bound']) for r in map(json.loads, sys.stdin)]"
METRICS='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
python3 .sweep/s25/ncu_matmul.py 6656 39936 16 > /dev/null 2>&1
timeout ${T3:-150} ncu --kernel-name regex:tensor_q4 --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats --section WarpStateStats --section LaunchStats --metrics "$METRICS" python3 .sweep/s25/ncu_matmul.py 6656 39936 16 > $OUT/A-ncu-gateup16.txt 2>&1; echo ncu rc=$?
grep -iE "error|Duration|SM Frequency|Issued Ipc|Achieved Occupancy|Registers Per|Grid Size|DRAM Through|Memory Throughput|Warp Cycles Per Issued|SM Active|Elapsed Cycles|Issue Slots|stalled_(long|wait|math|barrier|short|mio|not_sel|lg)" $OUT/A-ncu-gateup16.txt | head -30
