#!/bin/bash
# session 27, call E: rounds at tau 6 (4-bit, 4k) with the scaled-weight form (the default) against the unscaled
# one in the same processes; then the side by side against the public loop with the defaults of now.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-E.txt 2>&1
timeout ${T1:-260} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 3 --kernels default,default-unscaled --json $OUT/E-rp-4k.json > $OUT/E-rp-4k.txt 2>&1; echo rp rc=$?; grep "^{" $OUT/E-rp-4k.txt | cut -c1-300 | tail -10
if [ "${SBS:-1}" = 1 ]; then
timeout ${T2:-300} python3 -m benchmarks.side_by_side --out $OUT/E-sbs --peer-src $PWD/.sweep/peer -- --scale full --quant 4bit --context 4096 --max-tokens 96 --replay-tau 6 --passes 2 > $OUT/E-sbs.txt 2>&1; echo sbs rc=$?; tail -12 $OUT/E-sbs.txt | cut -c1-300
fi
