#!/bin/bash
# For the next lease (written in session 56, which had no device; not yet run): the
# persistent matmul (DFLASH_QMM_PERSISTENT=1, read at each bind). Its cuda tests (the
# fused gate / up and the LM head, persistent against plain, bit for bit), then per
# call with the weights cold (the two multi-wave 4-bit calls, and o_proj, a one-wave
# control the switch leaves alone), forms alternated twice, then whole rounds.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/C
P="python3 -m pytest -q -p no:cacheprovider -rf"
timeout 200 $P tests/test_tensor_persistent.py -m cuda > $OUT/C/c1-tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/C/c1-tests.txt | tail -4 | cut -c1-300
S="mlp gate+up fused;lm_head;o_proj"
timeout 200 python3 -m benchmarks.matmul_variants --variants current,persistent,current,persistent --rows 1,16 --shapes "$S" --cold-bytes 268435456 --json $OUT/C/persistent-cold.json > $OUT/C/persistent-cold.txt 2>&1; echo calls rc=$?
tail -30 $OUT/C/persistent-cold.txt | cut -c1-200
A=default,default-persist,default,default-persist
timeout 300 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --runs 1 --kernels $A --device-time --json $OUT/C/rounds.json > $OUT/C/rounds.txt 2>&1; echo "rounds rc=$?"
python3 - $OUT/C/rounds.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["device_time"]:
    q4 = sum(v for n, v in r["top_us"].items() if "tensor_q4" in n)
    print(r["run"], r.get("arm"), "busy", r["busy_ms"], "kernels", r["kernels"], "q4 us", round(q4, 1))
print("lossless", [x["lossless"] for x in d["runs"]], "plain = mlx-lm", d["plain_equals_mlx_lm"])
PY
