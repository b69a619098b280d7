#!/bin/bash
# Session 75: the lean byte decode's own `cuda` test at groups of 32, 64 and 128 (every
# 8-bit Glimmer projection, 1 / 16 / 32 rows, unscaled and scaled), graphs off as in
# session 71. Usage, from the repository root with the tree in .sweep/s66/cur.
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/T
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
t0=$(date +%s)
(cd .sweep/s66/cur && PYTHONPATH=$PWD:$PWD/tests:/tmp/site MLX_USE_CUDA_GRAPHS=0 timeout ${PER:-300} python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_tensor_qmm.py -k lean_byte -rA > $OUT/T/lean-bytes-cuda.txt 2>&1)
echo "pytest rc=$? $(( $(date +%s)-t0 ))s"; tail -3 $OUT/T/lean-bytes-cuda.txt | cut -c1-300
