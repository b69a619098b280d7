#!/bin/bash
# For the next lease (written in session 51, not yet run): where whole rounds with the paired stage / lean issue
# lose ~0.9 ms. One process alternates the arms in-process (round_profile's -pairedlean / -paired / -lean arms
# rebuild the matmul's forms for their block), with the default arm twice as an A/A control; --device-time
# writes each kernel name's device us a round (top_us) per arm.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/J
A=default,default-pairedlean,default,default-paired,default-lean
timeout 500 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --kernels $A --device-time --json $OUT/J/rounds-arms.json > $OUT/J/rounds-arms.txt 2>&1; echo "rounds rc=$?"
python3 - $OUT/J/rounds-arms.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
base = None
for r in d["device_time"]:
    if not r["run"].startswith("dflash"):
        continue
    print(r["arm"], "busy", r["busy_ms"], "kernels", r["kernels"])
    top = r.get("top_us", {})
    if base is None:
        base = top
    for name, us in list(top.items())[:12]:
        print(f"   {us:8.1f} {us - base.get(name, 0.0):+7.1f}  {name[:80]}")
print("lossless", [x["lossless"] for x in d["runs"]], "plain = mlx-lm", d["plain_equals_mlx_lm"])
PY
cd $OUT && tar czf J.tgz J && rm -rf J
