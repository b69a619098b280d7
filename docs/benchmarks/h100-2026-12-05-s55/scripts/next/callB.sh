#!/bin/bash
# For the next lease (written in session 55, not yet run), once interleaved scales are the
# default: the default's cuda tests in the new text, then whole rounds against the
# "-cmajor" arm (chunk-major scales without the interleaving; added in session 55).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/B
P="python3 -m pytest -q -p no:cacheprovider -rf"
timeout 200 $P tests/test_tensor_qmm.py -m cuda -k "every_scaled_kernel or denormal" > $OUT/B/b1-default.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/B/b1-default.txt | tail -4 | cut -c1-300
A=default,default-cmajor,default,default-cmajor
timeout 300 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --runs 1 --kernels $A --device-time --json $OUT/B/rounds.json > $OUT/B/rounds.txt 2>&1; echo "rounds rc=$?"
python3 - $OUT/B/rounds.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["device_time"]:
    q4 = sum(v for n, v in r["top_us"].items() if "tensor_q4" in n)
    print(r["run"], r.get("arm"), "busy", r["busy_ms"], "kernels", r["kernels"], "q4 us", round(q4, 1))
print("lossless", [x["lossless"] for x in d["runs"]], "plain = mlx-lm", d["plain_equals_mlx_lm"])
PY
