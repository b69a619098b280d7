#!/bin/bash
# session 32, call C: launch scalars host-made vs device-made (CUPTI, reused and fresh), then the 4-bit loop.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-C.txt 2>&1
timeout 150 python3 .sweep/s32/resident_time.py $OUT/C-time.json 2 > $OUT/C-time.txt 2>&1; echo time rc=$?
grep -v '^{' $OUT/C-time.txt | cut -c1-160 | tail -45
timeout 300 python3 .sweep/s32/loop_probe.py $OUT/C-loop.json 4bit > $OUT/C-loop.txt 2>&1; echo loop rc=$?
tail -32 $OUT/C-loop.txt | cut -c1-300
