#!/bin/bash
# Written in session 76 (no device), for the next lease: the denormal 4-bit decode's own
# `cuda` test at groups of 32, 64 and 128 (every 4-bit Glimmer projection, 1 / 16 / 32
# rows, pairs in place or not: 90 cases), graphs off as in session 75's callT.sh. A
# trained 4-bit target in groups of 32 / 128 takes these forms by default since session
# 74 (its scales lie below 2^-5); their own bits against the scaled form have not been
# compared on a GPU (sessions 73-74 ran them only inside whole loops, lossless).
# Usage, from the repository root with the tree in .sweep/s66/cur.
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/U
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
t0=$(date +%s)
(cd .sweep/s66/cur && PYTHONPATH=$PWD:$PWD/tests:/tmp/site MLX_USE_CUDA_GRAPHS=0 timeout ${PER:-330} python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_tensor_qmm.py -k denormal_form_gives -rA > $OUT/U/denormal-cuda.txt 2>&1)
echo "pytest rc=$? $(( $(date +%s)-t0 ))s"; tail -3 $OUT/U/denormal-cuda.txt | cut -c1-300
