#!/bin/bash
# session 8, call 3: tensor-core attention: GPU tests, timing, round A/B
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv > $OUT/gpu.txt 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_tensor_attention.py -m cuda 2>&1 | tail -40 > $OUT/tests-tc.txt; tail -5 $OUT/tests-tc.txt
timeout 80 python3 -m benchmarks.verify_kernels --only attention --json $OUT/vk-attention.json > $OUT/vk-attention.txt 2>&1; tail -12 $OUT/vk-attention.txt
timeout 220 python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 2,6 --max-tokens 96 --runs 2 --kernels off,attention --json $OUT/rp-bf16-4k.json 2>&1 | tail -10
