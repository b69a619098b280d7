#!/bin/bash
# session 12, call B: the tensor-core matmul with the per-thread issue path: ncu, variants, CUDA tests
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
D=docs/benchmarks/h200-2026-12-01-s12
TORCHPY=/opt/torch/.venv/bin/python3
METRICS='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
python3 $D/ncu_matmul.py 6656 19968 16 > /dev/null 2>&1  # compile outside ncu
timeout 90 ncu --kernel-name regex:tensor_q4 --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section LaunchStats --metrics "$METRICS" python3 $D/ncu_matmul.py 6656 19968 16 > $OUT/ncu-issue-6656x19968-r16.txt 2>&1
grep -iE "error|Duration|Executed Instructions  |Issued Ipc|Achieved Occupancy|Registers Per|Grid Size|DRAM Through|Warp Cycles Per Issued" $OUT/ncu-issue-6656x19968-r16.txt | head -12
timeout 240 $TORCHPY -m benchmarks.matmul_variants --variants current,target528,target1056 --json $OUT/variants-issue.json 2>&1 | cut -c1-200 | tail -40
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_tensor_qmm.py tests/test_verify_kernels.py -m cuda -k "matmul or tensor" > $OUT/pytest-cuda-matmul.txt 2>&1; echo rc=$?
tail -4 $OUT/pytest-cuda-matmul.txt
