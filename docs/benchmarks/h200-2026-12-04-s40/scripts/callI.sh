#!/bin/bash
# session 40, call I: the standard attention rows (ours in every layout, mlx's routes, cuDNN) with CUPTI device time.
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 170 python3 -m benchmarks.verify_kernels --only attention --device-time --json $OUT/I-vk-attention.json > $OUT/I-vk-attention.txt 2>&1; echo rc=$?
grep -v Warning $OUT/I-vk-attention.txt | tail -40 | cut -c1-220
