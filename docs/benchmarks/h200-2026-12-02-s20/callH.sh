#!/bin/bash
# session 20, call H: the queries read in place -- attention cuda tests whole, the layer's kernels, kernel-patch tests
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${T1:-200} python3 -m pytest -q -p no:cacheprovider tests/test_tensor_attention.py tests/test_verify_kernels.py -k "cuda" > $OUT/pytest-attention-cuda-h.txt 2>&1; echo attn rc=$?; tail -2 $OUT/pytest-attention-cuda-h.txt
timeout ${T2:-70} python3 -m benchmarks.layer_stack --quant 4bit --layers 4 --context 4096 --arms ours --forwards 10 --passes 1 --trace --json $OUT/stack-h.json > $OUT/stack-h.txt 2>&1; echo stack rc=$?
python3 -c "
import json; d=json.load(open('$OUT/stack-h.json'))
for a,t in d['traces'].items(): print(a, t['kernels_per_layer'], t['busy_us_per_layer']); print(t['sequence'])" 2>&1 | cut -c1-2500
timeout ${T3:-150} python3 -m pytest -q -p no:cacheprovider tests/test_fused_projections.py tests/test_kernel_patch.py > $OUT/pytest-kernel-patch-h.txt 2>&1; echo kp rc=$?; tail -2 $OUT/pytest-kernel-patch-h.txt
