#!/bin/bash
# session 52, call M: whole DFlash rounds at tau = 6, 4-bit, full-size, one process alternating the arms in-process:
# the default (twice, an A/A control), the denormal decode's pairs in place, and the paired stage + lean issue;
# --device-time writes each kernel name's device us a round (top_us) per arm.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/M
A=default,default-inplace,default-pairedlean,default,default-inplace,default-pairedlean
timeout 470 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --kernels $A --device-time --json $OUT/M/rounds-arms.json > $OUT/M/rounds-arms.txt 2>&1; echo "rounds rc=$?"
python3 - $OUT/M/rounds-arms.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for row in d["arms"]:
    print(json.dumps(row)[:300])
base = None
for r in d["device_time"]:
    print(r["run"], r.get("arm"), "busy", r["busy_ms"], "kernels", r["kernels"])
    if not r["run"].startswith("dflash"):
        continue
    top = r.get("top_us", {})
    if base is None:
        base = top
    for name, us in list(top.items())[:14]:
        print(f"   {us:8.1f} {us - base.get(name, 0.0):+7.1f}  {name[:90]}")
print("lossless", [x["lossless"] for x in d["runs"]], "plain = mlx-lm", d["plain_equals_mlx_lm"])
PY
cd $OUT && tar czf M.tgz M && rm -rf M
