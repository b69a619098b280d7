#!/bin/bash
# session 40, call F (run inline as this command): bf16 in the loop, the default (verify kernels off for bf16) then with them on.
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 500 python3 -m benchmarks.pacing_ab --scale full --quant bf16 --context 4096 --tokens 96 --arms 0,4 --reps 4 --json $OUT/F-pacing_bf16_default.json 2>&1 | grep -v Warning | tail -6
DFLASH_VERIFY_KERNELS=1 timeout 300 python3 -m benchmarks.pacing_ab --scale full --quant bf16 --context 4096 --tokens 96 --arms 0,4 --reps 4 --json $OUT/F-pacing_bf16_kernels.json 2>&1 | grep -v Warning | tail -6
