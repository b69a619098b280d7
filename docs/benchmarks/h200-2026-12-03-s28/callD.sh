#!/bin/bash
# session 28, call D: every scaled kernel once on the GPU (24 plain, 12 SwiGLU two-K-group); then per-round
# durations of plain and replay-tau6 generations with full blocks to the end (full 4-bit, 4k).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
P="python3 -m pytest -q -p no:cacheprovider"
timeout 150 $P tests/test_tensor_qmm.py -m cuda -k every_scaled_kernel > $OUT/D-pytest-every-scaled.txt 2>&1 &
timeout 150 $P tests/test_gated_mlp.py -m cuda -k every_group_size > $OUT/D-pytest-every-swiglu.txt 2>&1 &
wait
for f in $OUT/D-pytest-*.txt; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" $f | tail -4 | cut -c1-300; done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-D.txt 2>&1
timeout 200 python3 .sweep/s28/rounds.py $OUT/D-rounds.json > $OUT/D-rounds.txt 2>&1; echo rounds rc=$?; cut -c1-300 $OUT/D-rounds.txt
