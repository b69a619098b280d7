#!/bin/bash
# Session 58, call 4 (call 2 at bf16, results in E/): whole rounds alternated, two runs
# each.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/E
A=default-residual,default
timeout 420 python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --max-tokens 64 --runs 2 --kernels $A --device-time --json $OUT/E/rounds.json > $OUT/E/rounds.txt 2>&1; echo "rounds rc=$?"
python3 - $OUT/E/rounds.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["device_time"]:
    q4 = sum(v for n, v in r["top_us"].items() if "tensor_q4" in n)
    norm = sum(v for n, v in r["top_us"].items() if "rms_norm" in n or "residual_norm" in n)
    add = sum(v for n, v in r["top_us"].items() if "Add" in n)
    print(r["run"], r.get("arm"), "busy", r["busy_ms"], "kernels", r["kernels"], "q4 us", round(q4, 1), "norms us", round(norm, 1), "adds us", round(add, 1))
print("lossless", [x["lossless"] for x in d["runs"]], "plain = mlx-lm", d["plain_equals_mlx_lm"])
PY
grep -E '"round_median"' $OUT/E/rounds.txt | cut -c1-300
