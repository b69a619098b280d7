#!/bin/bash
# session 28, call C: per-round durations of replay-tau6 generations (full 4-bit, 4k), each call installing the
# kernels itself, then four inside one held patch (kernel_patch.verify_kernels around them).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 400 python3 .sweep/s28/rounds.py $OUT/C-rounds.json > $OUT/C-rounds.txt 2>&1; echo rounds rc=$?; cat $OUT/C-rounds.txt | cut -c1-400
