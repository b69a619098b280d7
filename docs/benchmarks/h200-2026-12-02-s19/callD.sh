#!/bin/bash
# session 19, call D: the GPU tests of the changed kernels (member-major fused store, fold storing (B, S, H, D)) and the route
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt 2>&1
python3 -c "
from dflash.metal import attention, tensor_attention, tensor_qmm
names = sorted({tensor_attention.attend_spec(128, l).name('cuda') for l in tensor_attention.LAYOUTS.values()} | {attention.FOLD_CHUNKS.name('cuda')} | {s.name('cuda') for s in tensor_qmm.SPECS})
print('\n'.join(names))" > $OUT/shipped-names.txt 2>&1
timeout ${T1:-170} python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -k "cuda" > $OUT/pytest-tensor-qmm-cuda.txt 2>&1; echo qmm rc=$?; tail -2 $OUT/pytest-tensor-qmm-cuda.txt
timeout ${T2:-170} python3 -m pytest -q -p no:cacheprovider tests/test_tensor_attention.py tests/test_verify_kernels.py -k "cuda" > $OUT/pytest-attention-cuda.txt 2>&1; echo attn rc=$?; tail -2 $OUT/pytest-attention-cuda.txt
timeout ${T3:-230} python3 -m pytest -q -p no:cacheprovider tests/test_fused_projections.py tests/test_kernel_patch.py > $OUT/pytest-route.txt 2>&1; echo route rc=$?; tail -2 $OUT/pytest-route.txt
