#!/bin/bash
# session 41, call B: the pacing arms with an A/A control (4 and its copy 4/b), full-size 4-bit, 4k, replayed tau 6.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader; nproc
timeout 575 python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms 0,auto,4,4/b --reps 4 --json $OUT/B-pacing_aa.json 2>&1 | grep -v Warning | tail -30
