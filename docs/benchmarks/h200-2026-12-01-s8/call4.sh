#!/bin/bash
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
(which ncu; ls /usr/local/cuda*/bin 2>/dev/null | grep -i ncu) > $OUT/ncu.txt 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py tests/test_tensor_attention.py tests/test_verify_kernels.py -m cuda 2>&1 | tail -40 > $OUT/tests-cuda.txt; tail -4 $OUT/tests-cuda.txt
timeout 120 /opt/torch/.venv/bin/python3 -m benchmarks.verify_kernels --device-time --reps 10 --batch 10 --json $OUT/vk-dev.json > $OUT/vk-dev.txt 2>&1
python3 - <<'PY'
import json,os
d=json.load(open(os.environ["OUT"]+"/vk-dev.json"))
for r in d["attention"]:
    print(r["context"],r["plane"],r["queries"],r["impl"][:24].ljust(24),"pipe %.0f dev %.1f"%(r["pipelined_us"],r.get("device_us",-1)))
for r in d["matmul"]:
    print(r["projection"][:14].ljust(14),r["weights"][:9].ljust(9),r["rows"],r["impl"][:8].ljust(8),"bound %.1f pipe %.1f dev %.1f"%(r["bound_us"],r["pipelined_us"],r.get("device_us",-1)))
PY
timeout 130 python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 6 --max-tokens 96 --runs 1 --kernels off,attention,matmul,all --json $OUT/rp-bf16-4k.json 2>&1 | grep "^{" | cut -c1-330
timeout 150 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 96 --runs 1 --kernels off,attention,matmul,all --json $OUT/rp-4bit-4k.json 2>&1 | grep "^{" | cut -c1-330
