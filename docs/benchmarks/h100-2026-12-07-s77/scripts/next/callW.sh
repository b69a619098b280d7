#!/bin/bash
# Session 77, for the next lease's first measuring call (after the cache parts' calls and
# the install). Loads the carried caches (cache.sh), then:
#  - on an H200: the 4-bit verify-forward goal (callH.sh, graphs off);
#  - on an H100: whether dflash's kernels compile again in every process. Two
#    verify_forward processes in a row, the same form and arm (today's defaults), each
#    reporting its first forward (first_forward_ms: the first launch of every kernel);
#    mlx writes no disk cache for custom kernels, so both should pay NVRTC for ours
#    (session 73: 11.7-19.1 s), and the second none for mlx's own.
# Then saves the caches. Env: QUANT (default 4bit), PER (seconds a process).
set -u
export PYTHONUNBUFFERED=1
bash .sweep/s66/cache.sh load
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "gpu: $gpu"
case "$gpu" in
  *H200*)
    RUNS="4bit:0" PER=${PER:-300} bash .sweep/s66/callH.sh ;;
  *)
    mkdir -p $OUT/F
    for i in 1 2; do
      t0=$(date +%s)
      (cd .sweep/s66/cur && PYTHONPATH=$PWD:/tmp/site MLX_USE_CUDA_GRAPHS=0 \
        timeout ${PER:-200} python3 -m benchmarks.verify_forward --scale full \
        --quant ${QUANT:-4bit} --context 4096 --kernels default --reps 3 --warmup 1 \
        --json $OUT/F/first-$i.json > $OUT/F/first-$i.txt 2>&1)
      echo "process $i rc=$? $(( $(date +%s)-t0 ))s"
      grep -v Warning $OUT/F/first-$i.txt | grep -v warn_once | tail -3 | cut -c1-300
    done ;;
esac
bash .sweep/s66/cache.sh save
