#!/bin/bash
# session 53, call V: what the 4-bit call's non-weight copies cost (x, scales, biases), 16 and 1 rows, cold.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/V
timeout 110 python3 -m benchmarks.matmul_variants --variants shifted,memonly,memonly-nox,memonly-noscales,noscales --rows 16 --shapes "mlp gate+up fused;mlp down;o_proj" --cold-bytes 268435456 --json $OUT/V/copies.json > $OUT/V/copies.txt 2>&1; echo rc=$?
python3 - $OUT/V/copies.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(r["projection"], r["rows"], r["variant"], r["device_us"], r["over_bound"])
PY
cd $OUT && tar czf V.tgz V && rm -rf V
