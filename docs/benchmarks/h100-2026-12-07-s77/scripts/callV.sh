#!/bin/bash
# Session 77: the lease's first measuring call. Loads the carried compile caches (session
# 76's cache.sh); on an H200 runs the issue's verify-forward goals (callH.sh); on an H100
# first one 4-bit groups-of-32 process with graphs on (M: the form session 76 compiled, so
# its time says whether the carried caches spare the first process the compiles), then
# groups-of-128 loops with mlx's graphs on (M) against off (K); saves the caches.
# Env: STEP (h200: "4bit" or "bf16"), PER (seconds a later process), FIRST (the first's).
set -u
bash .sweep/s66/cache.sh load
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "gpu: $gpu"
ROOT_OUT=$OUT
case "$gpu" in
  *H200*)
    case ${STEP:-4bit} in
      4bit) RUNS="4bit:0" PER=${PER:-300} bash .sweep/s66/callH.sh ;;
      bf16) RUNS="bf16:1 bf16:0" PER=${PER:-280} bash .sweep/s66/callH.sh ;;
    esac ;;
  *)
    OUT=$ROOT_OUT/g32 QUANT=4bit-g32 PER=${FIRST:-240} bash .sweep/s66/loop.sh "M"
    OUT=$ROOT_OUT/g128 QUANT=4bit-g128 PER=${PER:-150} bash .sweep/s66/loop.sh "${ARMS:-K M K M}" ;;
esac
OUT=$ROOT_OUT bash .sweep/s66/cache.sh save
