#!/bin/bash
# session 14, call D: mlx's graph batching (MLX_MAX_OPS_PER_BUFFER), one process per value: DFlash rounds at 4-bit, 4k, arms off and all-merged
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
for v in ${VALUES:-100 400 50 200}; do
  MLX_MAX_OPS_PER_BUFFER=$v timeout ${EACH:-130} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs ${RUNS:-2} --kernels off,all-merged --json $OUT/rp-ops-$v.json > $OUT/rp-ops-$v.txt 2>&1; echo ops=$v rc=$?
  grep "^{" $OUT/rp-ops-$v.txt | cut -c1-240 | tail -6
done
