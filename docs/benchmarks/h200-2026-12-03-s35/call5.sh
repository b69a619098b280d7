#!/bin/bash
# session 35, call 5: our bf16 plain decoding with the verify kernels against without (and mlx-lm's),
# the question that keeps bf16's default off (session 24: slower with them).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 185 python3 -m benchmarks.plain_phases --scale full --quant bf16 --context 4096 --tokens 40 --passes 2 --kernels off,all --json $OUT/plain-bf16.json > $OUT/plain-bf16.txt 2>&1; echo ppbf rc=$?
grep "^{" $OUT/plain-bf16.txt | cut -c1-300 | tail -12
tail -5 $OUT/plain-bf16.txt | cut -c1-300
