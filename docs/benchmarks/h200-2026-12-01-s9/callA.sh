#!/bin/bash
# session 9, call A: attention chunk sweep, host cost per call, graphs on/off in the loop
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TP=/opt/torch/.venv/bin/python3
(ls /usr/local/cuda/bin; which nsys; git log --oneline -1) > $OUT/tools.txt 2>&1
timeout 150 $TP -m benchmarks.verify_kernels --only attention --device-time --chunks 64,128,256 --skip-scalar --reps 10 --batch 10 --json $OUT/vk-chunks.json > $OUT/vk-chunks.txt 2>&1
python3 - <<'PY'
import json,os
d=json.load(open(os.environ["OUT"]+"/vk-chunks.json"))
for r in d["attention"]:
    print(r["context"],r["plane"],r["queries"],r["impl"][:24].ljust(24),r.get("chunk"),"pipe %.0f dev %.1f diff %.2g"%(r["pipelined_us"],r.get("device_us",-1),r["max_abs_diff_vs_mlx"]))
PY
timeout 50 $TP -m benchmarks.launch_cost --device-time --json $OUT/launch-graphs.json --cprofile "ours small_row_matmul" > $OUT/launch-graphs.txt 2>&1; head -5 $OUT/launch-graphs.txt
MLX_USE_CUDA_GRAPHS=0 timeout 50 $TP -m benchmarks.launch_cost --device-time --json $OUT/launch-nographs.json > $OUT/launch-nographs.txt 2>&1; head -5 $OUT/launch-nographs.txt
timeout 120 python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 6 --max-tokens 96 --runs 1 --kernels off,attention --json $OUT/rp-bf16-4k-graphs.json 2>&1 | grep "^{" | cut -c1-400
MLX_USE_CUDA_GRAPHS=0 timeout 120 python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 6 --max-tokens 96 --runs 1 --kernels off,attention --json $OUT/rp-bf16-4k-nographs.json 2>&1 | grep "^{" | cut -c1-400
if command -v nsys >/dev/null || [ -x /usr/local/cuda/bin/nsys ]; then
  NS=$(command -v nsys || echo /usr/local/cuda/bin/nsys)
  timeout 60 $NS profile -t cuda,nvtx -o /tmp/lc -f true python3 -m benchmarks.launch_cost --calls 100 --reps 2 > /dev/null 2>&1
  timeout 30 $NS stats -r nvtx_sum,cuda_api_sum /tmp/lc.nsys-rep > $OUT/nsys-launch.txt 2>&1; head -60 $OUT/nsys-launch.txt
fi
