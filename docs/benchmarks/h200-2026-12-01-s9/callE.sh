#!/bin/bash
# session 9, call E: 4-bit matmul device time per projection, fused sibling shapes included
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 170 /opt/torch/.venv/bin/python3 -m benchmarks.verify_kernels --only matmul --bits 4 --skip-lm-head --device-time --reps 10 --batch 10 --json $OUT/vk-matmul-4bit.json > $OUT/vk-matmul-4bit.txt 2>&1
python3 - <<'PY'
import json,os
d=json.load(open(os.environ["OUT"]+"/vk-matmul-4bit.json"))
for r in d["matmul"]:
    print(r["projection"][:24].ljust(24),r["rows"],r["impl"][:8].ljust(8),"bound %.1f pipe %.1f dev %.1f k/call %.1f"%(r["bound_us"],r["pipelined_us"],r.get("device_us",-1),r.get("kernels_per_call",-1)))
PY
