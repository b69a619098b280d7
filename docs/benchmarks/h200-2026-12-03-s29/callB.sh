#!/bin/bash
# session 29, call B: bf16 side by side with full blocks (4k, tau 6, 96 tokens, 3 passes).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-B.txt 2>&1
timeout 560 python3 -m benchmarks.side_by_side --out $OUT/B-sbs-bf16 --peer-src $PWD/.sweep/peer -- --scale full --quant bf16 --context 4096 --max-tokens 96 --replay-tau 6 --passes 3 > $OUT/B-sbs-bf16.txt 2>&1; echo sbs rc=$?; tail -12 $OUT/B-sbs-bf16.txt | cut -c1-300
