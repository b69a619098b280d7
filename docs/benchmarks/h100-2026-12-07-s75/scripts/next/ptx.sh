#!/bin/bash
# Superseded in session 76 by docs/benchmarks/h100-2026-12-07-s76/scripts/cache.sh. Run
# after a pytest of our kernels only, this saved an empty archive: mlx's disk cache held
# none of dflash's custom kernels (only, after later loops, 21 files of mlx's own fused
# ops), and what persisted for them was the CUDA driver's ~/.nv/ComputeCache.
# For session 76 on: carry mlx's compiled-kernel disk cache from one lease to the next, so
# a lease's first process does not pay every NVRTC compile again (sessions 74-75: the
# first 4-bit process of a lease ran past its 265 / 140 s limit; later ones took 76-100 s).
# mlx keeps each compiled module (a cubin on sm_90, so the same file serves an H100 and an
# H200) at ${MLX_PTX_CACHE_DIR:-$TMPDIR/mlx/<mlx version>/ptx}/<module>.ptx, keyed by the
# module's name; our kernels' names carry a digest of their text, so a changed kernel
# misses the cache instead of loading a stale module.
# Usage, from the repository root on the device:
#   bash ptx.sh load   # before the first process: unpacks .sweep/ptx/ptx-*.part if present
#   bash ptx.sh save   # at the end of the lease's last call: packs the cache into $OUT/ptx/
# Then here: mkdir -p .sweep/ptx && cp <files_at>/ptx/ptx-*.part .sweep/ptx/ and carry
# ".sweep/ptx" with the next lease's install call.
set -u
cache=${TMPDIR:-/tmp}/mlx
case ${1:-} in
  load)
    if ls .sweep/ptx/ptx-*.part > /dev/null 2>&1; then
      mkdir -p $cache && cat .sweep/ptx/ptx-*.part | tar xzf - -C $cache
      echo "ptx cache loaded: $(find $cache -name '*.ptx' | wc -l) modules"
    else
      echo "no ptx cache to load"
    fi ;;
  save)
    mkdir -p $OUT/ptx
    tar czf - -C $cache . | split -b 15M -a 2 - $OUT/ptx/ptx-
    for f in $OUT/ptx/ptx-*; do mv $f $f.part; done
    echo "ptx cache saved: $(find $cache -name '*.ptx' | wc -l) modules, $(du -sh $OUT/ptx | cut -f1)" ;;
  *)
    echo "usage: ptx.sh load|save" >&2; exit 2 ;;
esac
