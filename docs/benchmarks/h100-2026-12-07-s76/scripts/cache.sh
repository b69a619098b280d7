#!/bin/bash
# Session 76: carry the compile caches from one lease to the next. What persisted between
# processes on an H100 (found after the lease's loops): mlx's disk cache of its own JIT
# kernels, /tmp/mlx/<mlx version>/ptx (21 files, 6.8 MB: fused elementwise ops; none of
# dflash's custom kernels), and the CUDA driver's cache of PTX compiled to SASS,
# ~/.nv/ComputeCache (136 MB; ~26 MB compressed with the former). Session 75's ptx.sh
# looked only for *.ptx under $TMPDIR/mlx and saved an empty archive.
# Usage, from the repository root on the device:
#   bash cache.sh load   # before the first process: unpacks .sweep/ptx/cache-*.part into /
#   bash cache.sh save   # in the lease's last call: packs both caches into $OUT/ptx/
# Then here: mkdir -p .sweep/ptx && cp <files_at>/ptx/cache-*.part .sweep/ptx/ and carry
# ".sweep/ptx" with the next lease's install call (with q5, p5 and .sweep/s66: ~45 MB).
set -u
case ${1:-} in
  load)
    if ls .sweep/ptx/cache-*.part > /dev/null 2>&1; then
      cat .sweep/ptx/cache-*.part | tar xzf - -C /
      echo "caches loaded: $(find /tmp/mlx -type f 2>/dev/null | wc -l) mlx files," \
        "$(du -sh /root/.nv/ComputeCache 2>/dev/null | cut -f1) driver cache"
    else
      echo "no cache to load"
    fi ;;
  save)
    mkdir -p $OUT/ptx
    tar czf - -C / tmp/mlx root/.nv 2>/dev/null | split -b 15M -a 2 - $OUT/ptx/cache-
    for f in $OUT/ptx/cache-*; do mv $f $f.part; done
    echo "caches saved: $(du -sh $OUT/ptx | cut -f1)" ;;
  *)
    echo "usage: cache.sh load|save" >&2; exit 2 ;;
esac
