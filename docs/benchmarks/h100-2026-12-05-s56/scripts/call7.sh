#!/bin/bash
# Session 56, call 7: interleaved scales (DFLASH_QMM_INTERLEAVED_SCALES=1 for the whole
# process, as the flipped default would be): the denormal / leading-shape cuda tests with
# the suffix check fixed, then rounds against the -cmajor arm (s55 callB's rounds).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DFLASH_QMM_INTERLEAVED_SCALES=1
mkdir -p $OUT/A $OUT/B
P="python3 -m pytest -q -p no:cacheprovider -rf"
timeout 200 $P tests/test_tensor_qmm.py -m cuda -k "denormal or leading_shape" > $OUT/A/a1-denormal-fixed.txt 2>&1
echo "== a1"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/A/a1-denormal-fixed.txt | tail -4 | cut -c1-300
A=default,default-cmajor,default,default-cmajor
timeout 330 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --runs 1 --kernels $A --device-time --json $OUT/B/rounds.json > $OUT/B/rounds.txt 2>&1; echo "rounds rc=$?"
python3 - $OUT/B/rounds.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["device_time"]:
    q4 = sum(v for n, v in r["top_us"].items() if "tensor_q4" in n)
    print(r["run"], r.get("arm"), "busy", r["busy_ms"], "kernels", r["kernels"], "q4 us", round(q4, 1))
print("lossless", [x["lossless"] for x in d["runs"]], "plain = mlx-lm", d["plain_equals_mlx_lm"])
PY
