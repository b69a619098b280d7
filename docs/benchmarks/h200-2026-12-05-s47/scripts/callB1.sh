#!/bin/bash
# session 47, call B1: the cuda tests of the matmul (dense CTAs priced at 8 chunks since s46, never run on a GPU
# with it), kernel patch, fused projections, cache kernels and the cluster sum; then the drafter's parts per part.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/B1
timeout 330 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_tensor_qmm.py tests/test_kernel_patch.py tests/test_fused_projections.py tests/test_metal_cuda.py tests/test_tensor_cluster.py > $OUT/B1/tests.txt 2>&1; echo tests rc=$?; tail -6 $OUT/B1/tests.txt
timeout 220 python3 -m benchmarks.drafter_forward --scale full --quant 4bit --context 4096 --kernels off,default,default-drafterqkv,default-drafterheads,default-draftermlx,default-draftertraced,default-drafterall --reps 20 --device --json $OUT/B1/drafter.json > $OUT/B1/drafter.txt 2>&1; echo drafter rc=$?
grep -v Warning $OUT/B1/drafter.txt | tail -9 | cut -c1-400
cd $OUT && tar czf B1.tgz B1 && rm -rf B1
