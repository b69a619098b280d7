#!/bin/bash
# session 29, call D: per-call install against a held patch (calls_probe.py); the attention calls now.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-D.txt 2>&1
timeout 280 python3 .sweep/s29/calls_probe.py $OUT/D-calls.json full > $OUT/D-calls.txt 2>&1; echo calls rc=$?; tail -20 $OUT/D-calls.txt | cut -c1-300
timeout 200 python3 -m benchmarks.verify_kernels --only attention --chunks 128,256 --skip-scalar --json $OUT/D-attention.json > $OUT/D-attention.txt 2>&1; echo attn rc=$?; tail -30 $OUT/D-attention.txt | cut -c1-250
