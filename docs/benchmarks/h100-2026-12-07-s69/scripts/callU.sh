#!/bin/bash
# Session 69 call U: the 46 `test_tensor_qmm` cuda tests session 68's call T did not reach
# (graphs off), in two parallel pytest processes on the one GPU, each under TPER seconds.
set -u
export PYTHONUNBUFFERED=1 MLX_USE_CUDA_GRAPHS=0
mkdir -p $OUT/T
nvidia-smi --query-gpu=name --format=csv,noheader
cd .sweep/s66/cur
export PYTHONPATH=$PWD:$PWD/tests:/tmp/site
t0=$(date +%s)
i=0; pids=""
for k in test_cuda_scaled_form_glimmer_shapes test_cuda_denormal_form_gives_the_scaled_bits; do
  i=$((i+1))
  timeout ${TPER:-300} python3 -m pytest -q -p no:cacheprovider -rf -m cuda tests/test_tensor_qmm.py -k $k > $OUT/T/u$i.txt 2>&1 &
  pids="$pids $!"
done
i=0
for p in $pids; do
  i=$((i+1)); wait $p; echo "== u$i rc=$? $(( $(date +%s)-t0 ))s"
  grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/T/u$i.txt | tail -6 | cut -c1-300
done
