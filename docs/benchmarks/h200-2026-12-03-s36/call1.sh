#!/bin/bash
# session 36, call 1: where a plain token's host build goes with the verify kernels (bf16, then 4-bit)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
for q in bf16 4bit; do
  timeout 250 python3 .sweep/s36/build_probe.py $OUT/probe-$q.json $q > $OUT/probe-$q.txt 2>&1; echo $q rc=$?
  grep -E "^setup|^[01] " $OUT/probe-$q.txt | cut -c1-900
done
timeout 200 python3 .sweep/s36/round_probe.py $OUT/round-4bit.json 4bit > $OUT/round-4bit.txt 2>&1; echo round rc=$?
grep -E "^setup|^\{" $OUT/round-4bit.txt | cut -c1-900
