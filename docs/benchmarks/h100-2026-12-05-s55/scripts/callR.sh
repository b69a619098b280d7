#!/bin/bash
# Session 55, call R: the fused gate / up per call, the two forms alternated twice (order check).
export PYTHONPATH=$PWD:/tmp/site && mkdir -p $OUT/R && timeout 150 python3 -m benchmarks.matmul_variants --variants interleaved,current,interleaved,current --rows 1,16 --shapes "mlp gate+up fused" --cold-bytes 268435456 --json $OUT/R/gateup-order.json > $OUT/R/gateup-order.txt 2>&1
