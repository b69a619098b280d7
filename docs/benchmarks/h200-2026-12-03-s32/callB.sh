#!/bin/bash
# session 32, call B: launch scalars host-made vs device-made (host * 1, stack of pool scalars) (CUPTI, reused and fresh), then the 4-bit loop.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-B.txt 2>&1
timeout 240 python3 .sweep/s32/resident_time_B.py $OUT/B-time.json 2 > $OUT/B-time.txt 2>&1; echo time rc=$?
grep -v '^{' $OUT/B-time.txt | cut -c1-160 | tail -45
timeout 300 python3 .sweep/s32/loop_probe.py $OUT/B-loop.json 4bit > $OUT/B-loop.txt 2>&1; echo loop rc=$?
tail -32 $OUT/B-loop.txt | cut -c1-300
