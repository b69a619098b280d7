#!/bin/bash
# session 36, call 2: the step memo (new) against the tree before (old, 2adf850), 4-bit tau-6 replay,
# alternated processes (old first); then our bf16 plain token with the kernels (new tree).
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/old && tar -xzf .sweep/s36/old.tgz -C /tmp/old
arm() {  # tree name
  PYTHONPATH=$1:/tmp/site timeout 150 python3 .sweep/s36/ab.py $OUT/ab-$2.json 4bit $2 > $OUT/ab-$2.txt 2>&1; echo "$2 rc=$?"
  grep -E "^summary|Error" $OUT/ab-$2.txt | cut -c1-300
}
arm /tmp/old old1; arm $PWD new1; arm /tmp/old old2; arm $PWD new2; arm /tmp/old old3; arm $PWD new3
export PYTHONPATH=$PWD:/tmp/site
timeout 120 python3 -m benchmarks.plain_phases --scale full --quant bf16 --context 4096 --tokens 40 --passes 2 --kernels off,all --json $OUT/plain-bf16.json > $OUT/plain-bf16.txt 2>&1; echo ppbf rc=$?
grep "^{" $OUT/plain-bf16.txt | cut -c1-300 | tail -8
