#!/bin/bash
# Session 55, call B2: whole rounds with interleaved scales (the "-ileave" arm), steady-state trace, arms alternated in one process,
# the default twice as an A/A control.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/B
A=default,default-ileave,default,default-ileave
timeout 400 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --runs 1 --kernels $A --device-time --json $OUT/B/rounds.json > $OUT/B/rounds.txt 2>&1; echo "rounds rc=$?"
python3 - $OUT/B/rounds.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["device_time"]:
    q4 = sum(v for n, v in r["top_us"].items() if "tensor_q4" in n)
    print(r["run"], r.get("arm"), "busy", r["busy_ms"], "kernels", r["kernels"], "q4 us", round(q4, 1))
print("lossless", [x["lossless"] for x in d["runs"]], "plain = mlx-lm", d["plain_equals_mlx_lm"])
PY
