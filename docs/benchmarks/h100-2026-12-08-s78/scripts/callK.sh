#!/bin/bash
# Session 78: dflash's CUDA kernels kept where mlx looks (metal/kept_modules.py).
# Part "tests": the kept-modules tests on CUDA. Then verify_forward processes in a row,
# all with MLX_PTX_CACHE_DIR=/root/kc (empty at first):
#   kept-cold (mlx compiles and writes its own kernels; ours compiled here and written),
#   kept-warm (everything loaded), off-warm (kept off: mlx's own loaded, ours compiled
#   by mlx as before session 78); off-cold is there for a fresh directory's control.
# Each reports first_forward_ms, prefill_s, the kept counts and the first logits' digest
# (the same digest: the kept images give mlx-compiled bits).
# Usage: PARTS="tests kept-cold kept-warm" bash callK.sh ; PARTS="off-warm" ...
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/K
cd .sweep/s66/cur
export PYTHONPATH=$PWD:$PWD/tests:/tmp/site
D=/root/kc; mkdir -p $D
for part in ${PARTS:-tests kept-cold kept-warm off-warm}; do
  t0=$(date +%s)
  case $part in
    tests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_kept_modules.py \
        > $OUT/K/tests.txt 2>&1
      echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -4 $OUT/K/tests.txt | cut -c1-400 ;;
    *)
      case $part in off-*) k=0 ;; *) k=1 ;; esac
      MLX_PTX_CACHE_DIR=$D DFLASH_KEPT_MODULES=$k MLX_USE_CUDA_GRAPHS=0 \
        timeout ${PER:-230} python3 -m benchmarks.verify_forward --scale full \
        --quant ${QUANT:-4bit} --context 4096 --kernels default --reps 3 --warmup 1 \
        --json $OUT/K/$part.json > $OUT/K/$part.txt 2>&1
      echo "$part rc=$? $(( $(date +%s)-t0 ))s; $(find $D -name '*.ptx' | wc -l) modules in $D"
      grep -v Warning $OUT/K/$part.txt | grep -v warn_once | tail -3 | cut -c1-400 ;;
  esac
done
