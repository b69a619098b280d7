#!/bin/bash
# Sessions 76-77: carry the compile caches from one lease to the next. What persists
# between processes on an H100: mlx's disk cache of its own JIT kernels,
# /tmp/mlx/<mlx version>/ptx (its fused ops and quantized matmuls, which mlx-lm's plain
# decoding in each benchmark process uses), and the CUDA driver's JIT cache,
# ~/.nv/ComputeCache (not broken down). dflash's own kernels are in neither: mlx writes
# no cache for custom kernels and compiles them straight to SASS (session 77).
# Session 77: a call's working tree (43.7 MB tracked) plus its carry must stay under
# 64 MiB, so the parts (15 MB each) cannot ride with the wheel's; each travels in a call
# of its own, copied to /root/ptx, before the install call.
# Usage, from the repository root on the device:
#   bash cache.sh load   # before the first process: unpacks the parts found in
#                        # /root/ptx and .sweep/ptx (any depth) into /, in name order
#   bash cache.sh save   # in the lease's last call: packs both caches into $OUT/ptx/
# Then here: put each saved part in its own folder, .sweep/ptx/p1 .. pN, and carry each
# in its own call: mkdir -p /root/ptx && cp .sweep/ptx/pI/* /root/ptx/
set -u
case ${1:-} in
  load)
    parts=$(find /root/ptx .sweep/ptx -name 'cache-*.part' 2>/dev/null |
      awk -F/ '{print $NF, $0}' | sort -u -k1,1 | cut -d' ' -f2)
    if [ -n "$parts" ]; then
      cat $parts | tar xzf - -C /
      echo "caches loaded from $(echo $parts | wc -w) parts:" \
        "$(find /tmp/mlx -type f 2>/dev/null | wc -l) mlx files," \
        "$(du -sh /root/.nv/ComputeCache 2>/dev/null | cut -f1) driver cache"
    else
      echo "no cache to load"
    fi ;;
  save)
    mkdir -p $OUT/ptx
    tar czf - -C / tmp/mlx root/.nv 2>/dev/null | split -b 15M -a 2 - $OUT/ptx/cache-
    for f in $OUT/ptx/cache-*; do mv $f $f.part; done
    echo "caches saved: $(du -sh $OUT/ptx | cut -f1) in $(ls $OUT/ptx | wc -l) parts" ;;
  *)
    echo "usage: cache.sh load|save" >&2; exit 2 ;;
esac
