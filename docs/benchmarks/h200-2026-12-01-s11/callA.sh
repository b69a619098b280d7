#!/bin/bash
# session 11, call A: plain decoding's host phases per kernel arm (4-bit, 4k), launch cost of bare custom kernels
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
git log --oneline -1 > $OUT/commit.txt 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt 2>&1
TP=/opt/torch/.venv/bin/python3
timeout 70 $TP -m benchmarks.launch_cost --calls 200 --reps 5 --device-time --ops "mlx add,custom kernel short source,custom kernel 12 KB source,mlx quantized_matmul 1 row,ours small_row_matmul 1 row,mlx sdpa 1 query,ours small_query_attention 1 query,mlx quantized_matmul,ours small_row_matmul" --json $OUT/launch-graphs.json > $OUT/launch-graphs.txt 2>&1; echo rc=$?
cut -c1-200 $OUT/launch-graphs.txt
timeout 300 python3 -m benchmarks.plain_phases --scale full --quant 4bit --context 4096 --tokens 40 --passes 2 --kernels off,attention,matmul,all --json $OUT/plain-phases-4bit.json > $OUT/plain-phases-4bit.txt 2>&1; echo rc=$?
cut -c1-220 $OUT/plain-phases-4bit.txt
