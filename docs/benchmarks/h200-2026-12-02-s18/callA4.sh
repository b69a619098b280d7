#!/bin/bash
# session 18, call A4 (inline command): the 4k verify layer stack with CUPTI, two K groups on
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1; mkdir -p $OUT; DFLASH_QMM_TWO_K_GROUPS=1 timeout 150 python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms mlx,ours --trace --json $OUT/layer-stack-4k-k2.json > $OUT/layer-stack-4k-k2.txt 2>&1; echo stack rc=$?
