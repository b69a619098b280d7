#!/bin/bash
# session 44, call C (run inline as this command): 4-bit at 32k again (call B's timed out at 160 s), two reps.
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1; mkdir -p $OUT
timeout 400 python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 32768 --tokens 96 --arms 0,4 --reps 2 --json $OUT/C-loop32k.json > $OUT/C-loop32k.txt 2>&1; echo loop32k rc=$?
