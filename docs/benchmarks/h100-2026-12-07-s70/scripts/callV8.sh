#!/bin/bash
# Session 70's next 8-bit step: the lean byte decode's `cuda` test; the verify forward
# with our matmul / every part / every part with the lean byte decode against mlx's
# (graphs off, then on); then whole 8-bit loops K (kernels, graphs off), L (K with the
# lean byte decode), N (mlx's matmuls, graphs on), M (kernels, graphs on). Not run yet.
# Usage, from the repository root with this folder's loop.sh and gcwrap.py in
# .sweep/s66/ and the tree in .sweep/s66/cur: bash callV8.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/V
nvidia-smi --query-gpu=name --format=csv,noheader
ROOT=$PWD
t0=$(date +%s)
(cd .sweep/s66/cur && PYTHONPATH=$PWD:$PWD/tests:/tmp/site MLX_USE_CUDA_GRAPHS=0 timeout ${TPER:-150} python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_tensor_qmm.py -k lean_byte > $OUT/V/lean-bytes-cuda.txt 2>&1)
echo "cuda tests rc=$? $(( $(date +%s)-t0 ))s"; tail -3 $OUT/V/lean-bytes-cuda.txt
for g in 0 1; do
  t0=$(date +%s)
  (cd .sweep/s66/cur && PYTHONPATH=$PWD:/tmp/site MLX_USE_CUDA_GRAPHS=$g timeout ${PER:-180} python3 -m benchmarks.verify_forward --scale full --quant 8bit --context 4096 --kernels all,all-leanbytes,matmul,off --reps 5 --warmup 2 --device --device-forwards 6 --json $OUT/V/verify-8bit-g$g.json > $OUT/V/verify-8bit-g$g.txt 2>&1)
  echo "graphs=$g rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/V/verify-8bit-g$g.txt | grep -v warn_once | tail -5 | cut -c1-300
done
QUANT=8bit PER=${LPER:-120} bash $ROOT/.sweep/s66/loop.sh "${LOOPS:-K N L M K N L M}"
