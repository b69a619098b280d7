#!/bin/bash
# session 40, call G (run inline as this command): 4-bit in the loop again, arms in the other order.
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 400 python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms 4,0 --reps 6 --json $OUT/G-pacing_4bit.json 2>&1 | grep -v Warning | tail -8
