#!/bin/bash
# session 36, call 3: CUDA traced-layer tests with the step memo; A/B pairs (new first, to take the
# JIT compile) against the tree before (2adf850); our bf16 plain token with the kernels.
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/old && tar -xzf .sweep/s36/old.tgz -C /tmp/old
PYTHONPATH=$PWD:/tmp/site timeout 100 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_traced_layers.py > $OUT/cuda-traced.txt 2>&1; echo cuda rc=$?; tail -2 $OUT/cuda-traced.txt
arm() {  # tree name limit
  PYTHONPATH=$1:/tmp/site timeout $3 python3 .sweep/s36/ab.py $OUT/ab-$2.json 4bit $2 > $OUT/ab-$2.txt 2>&1; echo "$2 rc=$?"
  grep -E "^summary|Error" $OUT/ab-$2.txt | cut -c1-300
}
arm $PWD new4 200; arm /tmp/old old4 120
PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m benchmarks.plain_phases --scale full --quant bf16 --context 4096 --tokens 40 --passes 2 --kernels off,all --json $OUT/plain-bf16.json > $OUT/plain-bf16.txt 2>&1; echo ppbf rc=$?
grep "^{" $OUT/plain-bf16.txt | cut -c1-300 | tail -8
arm $PWD new5 120; arm /tmp/old old5 120
