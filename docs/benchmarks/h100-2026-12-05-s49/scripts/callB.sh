#!/bin/bash
# session 49, call B: 16-row verify layers over a 4,096-row context (layer_stack --trace: device busy per layer),
# processes alternating the two session-48 switches off / on.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/B
for run in 1 2; do
  for s in 0 1; do
    DFLASH_QMM_VECTOR_MERGE=$s DFLASH_QMM_DENORMAL_Q4=$s timeout 120 python3 -m benchmarks.layer_stack --quant 4bit --arms ours --layers 8 --context 4096 --trace --json $OUT/B/stack-s$s-run$run.json > $OUT/B/stack-s$s-run$run.txt 2>&1; echo "stack s=$s run=$run rc=$?"
    grep -v Warning $OUT/B/stack-s$s-run$run.txt | grep -iE "busy|ours" | tail -3 | cut -c1-300
  done
done
cd $OUT && tar czf B.tgz B && rm -rf B
