#!/bin/bash
# Session 76: one driver for the lease's first measuring call. Loads the carried compile
# caches (session 76's cache.sh), then runs on an H200 the issue's verify-forward goals
# (callH.sh), on an H100 4-bit groups-of-32 loops with mlx's graphs on (M) against off
# (K); saves the caches.
# Env: STEP (h200: "4bit" or "bf16"; h100: a loop.sh arm list), PER (seconds a process).
set -u
bash .sweep/s66/cache.sh load
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "gpu: $gpu"
case "$gpu" in
  *H200*)
    case ${STEP:-4bit} in
      4bit) RUNS="4bit:0" PER=${PER:-300} bash .sweep/s66/callH.sh ;;
      bf16) RUNS="bf16:1 bf16:0" PER=${PER:-280} bash .sweep/s66/callH.sh ;;
      *) RUNS="$STEP" PER=${PER:-280} bash .sweep/s66/callH.sh ;;
    esac ;;
  *)
    QUANT=${QUANT:-4bit-g32} PER=${PER:-110} bash .sweep/s66/loop.sh "${STEP:-M K}" ;;
esac
bash .sweep/s66/cache.sh save
