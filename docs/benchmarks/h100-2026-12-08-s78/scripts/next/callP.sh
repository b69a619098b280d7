#!/bin/bash
# Session 79, for a lease: the prepared q / k / v / gate launch (DFLASH_QMM_PREPARED_HEADS,
# the head prep as the fused launch's last step; built and emulated on the CPU only).
# Parts:
#   tests        tests/test_prepared_qkv.py's cuda tests (the head prep kernel's bits at
#                full size) with mlx's graphs on (the merged split sum), then with them
#                off and the cluster sum on (each rank prepares its own rows);
#   verify-4bit  benchmarks.verify_forward, 4-bit at 4k, arms default and default-qkvprep
#                alternated in one process with CUPTI (--device): busy_ms, kernels a
#                forward (one launch a layer fewer), first logits;
#   verify-bf16  the same in bf16.
# Usage: PARTS="tests verify-4bit" bash callP.sh   (results under $OUT/P)
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/P
cd .sweep/s66/cur
export PYTHONPATH=$PWD:$PWD/tests:/tmp/site
for part in ${PARTS:-tests verify-4bit verify-bf16}; do
  t0=$(date +%s)
  case $part in
    tests)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_prepared_qkv.py \
        -k device > $OUT/P/tests-graphs.txt 2>&1
      echo "tests (graphs on) rc=$? $(( $(date +%s)-t0 ))s"; tail -2 $OUT/P/tests-graphs.txt
      MLX_USE_CUDA_GRAPHS=0 DFLASH_QMM_CLUSTER_SUM=1 timeout 200 python3 -m pytest -q \
        -p no:cacheprovider -rs tests/test_prepared_qkv.py -k device \
        > $OUT/P/tests-cluster.txt 2>&1
      echo "tests (cluster) rc=$? $(( $(date +%s)-t0 ))s"; tail -2 $OUT/P/tests-cluster.txt ;;
    verify-4bit|verify-bf16)
      quant=${part#verify-}
      MLX_USE_CUDA_GRAPHS=0 timeout ${PER:-400} python3 -m benchmarks.verify_forward \
        --scale full --quant $quant --context 4096 --kernels default,default-qkvprep \
        --reps 10 --warmup 2 --device --json $OUT/P/$part.json > $OUT/P/$part.txt 2>&1
      echo "$part rc=$? $(( $(date +%s)-t0 ))s"
      grep -v Warning $OUT/P/$part.txt | grep -v warn_once | tail -6 | cut -c1-400 ;;
  esac
done
