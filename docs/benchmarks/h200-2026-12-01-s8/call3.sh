#!/bin/bash
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_attention.py tests/test_verify_kernels.py -m cuda 2>&1 | tail -30 > $OUT/tests-cuda.txt; tail -4 $OUT/tests-cuda.txt
timeout 100 /opt/torch/.venv/bin/python3 -m benchmarks.verify_kernels --only attention --device-time --reps 20 --json $OUT/vk-attention-dev.json > $OUT/vk-attention-dev.txt 2>&1
python3 - <<'PY'
import json,os
d=json.load(open(os.environ["OUT"]+"/vk-attention-dev.json"))
for r in d["attention"]:
    print(r["context"],r["plane"],r["queries"],r["impl"][:22].ljust(22),"pipe %.0f dev %.1f"%(r["pipelined_us"],r.get("device_us",-1)), {k[30:52]:v for k,v in r.get("device_kernels_us",{}).items()})
PY
timeout 170 python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 2,6 --max-tokens 96 --runs 2 --kernels off,attention --json $OUT/rp-bf16-4k.json 2>&1 | grep "^{" | cut -c1-330
timeout 170 python3 -m benchmarks.round_profile --scale full --quant bf16 --context 32768 --tau 2,6 --max-tokens 64 --runs 1 --kernels off,attention --json $OUT/rp-bf16-32k.json 2>&1 | grep "^{" | cut -c1-330
