#!/bin/bash
# Session 68 call T: every `cuda` test at HEAD (graphs off, as the commands run), four
# parallel pytest processes on the one GPU, each under TPER seconds.
set -u
export PYTHONUNBUFFERED=1 MLX_USE_CUDA_GRAPHS=0
mkdir -p $OUT/T
nvidia-smi --query-gpu=name --format=csv,noheader
cd .sweep/s66/cur
export PYTHONPATH=$PWD:$PWD/tests:/tmp/site
G1="tests/test_tensor_qmm.py"
G2="tests/test_tensor_attention.py tests/test_metal_cuda.py tests/test_wired_cache.py"
G3="tests/test_verify_kernels.py tests/test_traced_layers.py tests/test_head_prep.py tests/test_fused_offsets.py"
G4="tests/test_tensor_cluster.py tests/test_tensor_direct.py tests/test_tensor_persistent.py tests/test_gated_mlp.py tests/test_residual_norm.py tests/test_prefetch.py"
t0=$(date +%s)
i=0; pids=""
for g in "$G1" "$G2" "$G3" "$G4"; do
  i=$((i+1))
  timeout ${TPER:-420} python3 -m pytest -q -p no:cacheprovider -rf -m cuda $g > $OUT/T/g$i.txt 2>&1 &
  pids="$pids $!"
done
i=0
for p in $pids; do
  i=$((i+1)); wait $p; echo "== g$i rc=$? $(( $(date +%s)-t0 ))s"
  grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/T/g$i.txt | tail -6 | cut -c1-300
done
