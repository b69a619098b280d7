#!/bin/bash
# Session 58, call 2: whole rounds, default-residual and default alternated, two runs
# each.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/C
A=default-residual,default
timeout 420 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --runs 2 --kernels $A --device-time --json $OUT/C/rounds.json > $OUT/C/rounds.txt 2>&1; echo "rounds rc=$?"
python3 - $OUT/C/rounds.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["device_time"]:
    q4 = sum(v for n, v in r["top_us"].items() if "tensor_q4" in n)
    norm = sum(v for n, v in r["top_us"].items() if "rms_norm" in n or "residual_norm" in n)
    add = sum(v for n, v in r["top_us"].items() if "Add" in n)
    print(r["run"], r.get("arm"), "busy", r["busy_ms"], "kernels", r["kernels"], "q4 us", round(q4, 1), "norms us", round(norm, 1), "adds us", round(add, 1))
print("lossless", [x["lossless"] for x in d["runs"]], "plain = mlx-lm", d["plain_equals_mlx_lm"])
PY
grep -E '"round_median"' $OUT/C/rounds.txt | cut -c1-300
