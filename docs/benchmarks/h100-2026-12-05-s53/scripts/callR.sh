#!/bin/bash
# For the next lease (written in session 52, not yet run): whole rounds with the steady-state device trace (each run
# traced past its prefill and first round, session 52), arms alternated in one process: the default (the pairs in
# place) twice as an A/A control, the paired stage + lean issue, and the pairs shifted.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/R
A=default,default-pairedlean,default-shifted,default,default-pairedlean,default-shifted
timeout 470 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --runs 1 --kernels $A --device-time --json $OUT/R/rounds.json > $OUT/R/rounds.txt 2>&1; echo "rounds rc=$?"
python3 - $OUT/R/rounds.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["device_time"]:
    q4 = sum(v for n, v in r["top_us"].items() if "tensor_q4" in n)
    print(r["run"], r.get("arm"), "busy", r["busy_ms"], "kernels", r["kernels"], "q4 us", round(q4, 1))
print("lossless", [x["lossless"] for x in d["runs"]], "plain = mlx-lm", d["plain_equals_mlx_lm"])
PY
cd $OUT && tar czf R.tgz R && rm -rf R
