#!/bin/bash
# session 28, call B: the side by side against the public loop with the defaults of now (4-bit, 4k, tau 6).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-B.txt 2>&1
timeout ${T2:-330} python3 -m benchmarks.side_by_side --out $OUT/B-sbs --peer-src $PWD/.sweep/peer -- --scale full --quant 4bit --context 4096 --max-tokens 96 --replay-tau 6 --passes 2 > $OUT/B-sbs.txt 2>&1; echo sbs rc=$?; tail -12 $OUT/B-sbs.txt | cut -c1-300
