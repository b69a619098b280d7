#!/bin/bash
# session 33, call C: side by side with the public loop (4-bit, 4k, tau 6, 96 tokens), the session's tree.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-C.txt 2>&1
timeout 420 python3 -m benchmarks.side_by_side --out $OUT/C-sbs --peer-src $PWD/.sweep/peer -- --scale full --quant 4bit --context 4096 --max-tokens 96 --replay-tau 6 --passes 3 > $OUT/C-sbs.txt 2>&1; echo sbs rc=$?; tail -14 $OUT/C-sbs.txt | cut -c1-300
