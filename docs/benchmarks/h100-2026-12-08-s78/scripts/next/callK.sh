#!/bin/bash
# Session 78, for the next lease: kept modules (metal/kept_modules.py) after the header fix.
# mlx reads every custom kernel's module from its cache directory when the file is there,
# whatever DFLASH_KEPT_MODULES says, so the two arms need directories of their own:
#   /root/kc-off:  off-cold (mlx compiles everything and writes only its own kernels),
#                  then off-warm (mlx's own loaded, ours compiled by mlx: today's cost);
#   /root/kc-kept: kept-cold (ours compiled here and written), then kept-warm (all loaded).
# Each process reports first_forward_ms, prefill_s, the kept counts and the first logits'
# digest (all four equal: the kept images give the bits of mlx's own compile).
# Part "tests": tests/test_kept_modules.py and tests/test_mlx_headers.py on CUDA (the print,
# doctored-module and Sigmoid-bits tests; mlx's headers read from the mapped libmlx).
# Usage: PARTS="tests off-cold off-warm" bash callK.sh ; PARTS="kept-cold kept-warm" ...
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/K
cd .sweep/s66/cur
export PYTHONPATH=$PWD:$PWD/tests:/tmp/site
for part in ${PARTS:-tests off-cold off-warm kept-cold kept-warm}; do
  t0=$(date +%s)
  case $part in
    tests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_kept_modules.py \
        tests/test_mlx_headers.py -k "not prelude and not every_package" \
        > $OUT/K/tests.txt 2>&1
      echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -4 $OUT/K/tests.txt | cut -c1-400 ;;
    *)
      case $part in off-*) k=0; D=/root/kc-off ;; *) k=1; D=/root/kc-kept ;; esac
      mkdir -p $D
      MLX_PTX_CACHE_DIR=$D DFLASH_KEPT_MODULES=$k MLX_USE_CUDA_GRAPHS=0 \
        timeout ${PER:-230} python3 -m benchmarks.verify_forward --scale full \
        --quant ${QUANT:-4bit} --context 4096 --kernels default --reps 3 --warmup 1 \
        --json $OUT/K/$part.json > $OUT/K/$part.txt 2>&1
      echo "$part rc=$? $(( $(date +%s)-t0 ))s; $(find $D -name '*.ptx' | wc -l) modules in $D"
      grep -v Warning $OUT/K/$part.txt | grep -v warn_once | tail -3 | cut -c1-400 ;;
  esac
done
