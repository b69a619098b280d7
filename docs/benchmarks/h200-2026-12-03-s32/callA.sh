#!/bin/bash
# session 32, call A: padded (16-byte) vs unpadded launch scalar arrays: CUPTI device time, then Nsight Compute cycles.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT /tmp/A
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-A.txt 2>&1
python3 -c "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__, mx.default_device())"
timeout 200 python3 .sweep/s32/pad_time.py $OUT/A-time.json 3 > $OUT/A-time.txt 2>&1; echo time rc=$?
grep -v '^{"round' $OUT/A-time.txt | grep -E "pad|median|rror" | paste - - | cut -c1-200 | head -30
M="--metrics gpc__cycles_elapsed.max,sm__cycles_active.avg,smsp__inst_executed.sum,launch__grid_size,launch__block_size,launch__registers_per_thread"
for c in "4096 growing 16" "4096 growing 1" "4096 ring 16"; do
  tag=$(echo $c | tr ' ' '-')
  timeout 90 ncu $M --kernel-name regex:"attend_chunks|fold|residual" --launch-count 40 -f -o /tmp/A/$tag python3 .sweep/s32/pad_probe.py $c 3 > /tmp/A/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "^pad|rror" /tmp/A/$tag.log | head -12
  ncu -i /tmp/A/$tag.ncu-rep --page raw --csv 2>/dev/null | python3 .sweep/s31/ncu_table.py
done 2>&1 | tee $OUT/A-ncu.txt
ls -la $OUT
