#!/bin/bash
# session 26, call D2: the kernel patch's bitwise plain / classic / DFlash agreement and the fused-MLP, traced-layer
# and layer-stack CUDA tests with the scaled-weight form as the default.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "agree_bitwise or generators_install or near_ties or default_on_only or with_or_without" > $OUT/D2-pytest-kernel-patch.txt 2>&1; echo kp rc=$?
tail -3 $OUT/D2-pytest-kernel-patch.txt
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gated_mlp.py tests/test_traced_layers.py tests/test_layer_stack.py tests/test_metal_cuda.py -m cuda > $OUT/D2-pytest-cuda-layers.txt 2>&1; echo layers rc=$?
tail -5 $OUT/D2-pytest-cuda-layers.txt
