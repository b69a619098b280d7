#!/bin/bash
# session 40, call E: the loop with the new texts: full-size 4-bit Glimmer, replayed tau 6, lossless check and x mlx-lm plain.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader; nproc
timeout 560 python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms 0,4 --reps 4 --json $OUT/E-pacing_4bit.json 2>&1 | grep -v Warning | tail -20
