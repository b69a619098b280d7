#!/bin/bash
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 150 /opt/torch/.venv/bin/python3 -m benchmarks.verify_kernels --only attention --device-time --reps 20 --json $OUT/vk-attention-dev.json > $OUT/vk-attention-dev.txt 2>&1
python3 - <<'PY'
import json,os
d=json.load(open(os.environ["OUT"]+"/vk-attention-dev.json"))
for r in d["attention"]:
    print(r["context"],r["plane"],r["queries"],r["impl"][:22].ljust(22),"pipe %.0f dev %.1f k/call %.1f"%(r["pipelined_us"],r.get("device_us",-1),r.get("kernels_per_call",-1)), {k[:40]:v for k,v in r.get("device_kernels_us",{}).items()})
PY
tail -3 $OUT/vk-attention-dev.txt
