#!/bin/bash
# session 12, call A: GPU tests with TF32 off; ncu of the 4-bit matmul (ours and mlx's); layout variants
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
D=docs/benchmarks/h200-2026-12-01-s12
TORCHPY=/opt/torch/.venv/bin/python3
METRICS='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
for shape in "6656 19968 16" "6656 19968 1" "19968 6656 16"; do
  set -- $shape
  timeout 60 ncu --kernel-name regex:tensor_q4 --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats --metrics "$METRICS" python3 $D/ncu_matmul.py $1 $2 $3 > $OUT/ncu-ours-$1x$2-r$3.txt 2>&1
  grep -iE "error|Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Grid Size|Memory Throughput|DRAM Through|Compute \(SM\)|Warp Cycles Per Issued|Issued Warp|No Eligible|stalled_(barrier|long_scoreboard|short_scoreboard|wait|math_pipe|mio_throttle|not_selected|lg_throttle|dispatch|no_instruction|branch|tex)" $OUT/ncu-ours-$1x$2-r$3.txt | head -40
done
timeout 60 ncu --kernel-name regex:"qmm|qmv|gemv|affine" --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats python3 $D/ncu_matmul.py 6656 19968 16 > $OUT/ncu-mlx-6656x19968-r16.txt 2>&1
grep -iE "error|custom|affine|qmm|Duration|Grid Size|Block Size|Registers Per|DRAM Through|Achieved Occ" $OUT/ncu-mlx-6656x19968-r16.txt | head -12
timeout 200 $TORCHPY -m benchmarks.matmul_variants --json $OUT/variants.json 2>&1 | cut -c1-260 | tail -60
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py tests/test_fused_projections.py > $OUT/pytest-patch-fused-gpu.txt 2>&1; echo rc=$?
tail -6 $OUT/pytest-patch-fused-gpu.txt
