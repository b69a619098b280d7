#!/bin/bash
# Session 56, call 5: the persistent matmul per call, weights cold, forms alternated twice.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/C
S="mlp gate+up fused;lm_head;o_proj"
timeout 400 python3 -m benchmarks.matmul_variants --variants current,persistent,current,persistent --rows 1,16 --shapes "$S" --cold-bytes 268435456 --json $OUT/C/persistent-cold.json > $OUT/C/persistent-cold.txt 2>&1; echo calls rc=$?
tail -40 $OUT/C/persistent-cold.txt | cut -c1-220
