#!/bin/bash
# Session 73: our plain tokens against mlx-lm's (the divergences and mlx-lm's top-2 margin
# where they part), and whole tau = 6 rounds, kernel arms in one process: 8-bit groups of
# 64 by default (today's defaults against kernels off). Env: QUANT (a scale-target form),
# KERNELS (round_profile's --kernels), GRAPHS (MLX_USE_CUDA_GRAPHS; unset: mlx's default).
# For a form not in the default table: QUANT=4bit-g32 KERNELS=all,off GRAPHS=0.
# Usage, from the repository root with the tree in .sweep/s66/cur: bash callR.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/R
q=${QUANT:-8bit}
graphs=${GRAPHS:+MLX_USE_CUDA_GRAPHS=$GRAPHS}
t0=$(date +%s)
(cd .sweep/s66/cur && env PYTHONPATH=$PWD:/tmp/site $graphs timeout ${PER:-200} python3 -m benchmarks.round_profile --scale full --quant $q --context 4096 --max-tokens 64 --runs 1 --kernels ${KERNELS:-default,off} --plain-time --json $OUT/R/rp-$q.json > $OUT/R/rp-$q.txt 2>&1)
echo "round_profile $q rc=$? $(( $(date +%s)-t0 ))s"
python3 - $OUT/R/rp-$q.json <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("no json", e); sys.exit()
print("plain_equals_mlx_lm", r.get("plain_equals_mlx_lm"))
print("plain_divergences", r.get("plain_divergences"))
for k in ("arms", "plain_wall"):
    for row in r.get(k, []):
        print(k, json.dumps(row)[:300])
PY
