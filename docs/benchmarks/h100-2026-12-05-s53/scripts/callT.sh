#!/bin/bash
# session 53, call T: the tensor-map box copy (tma-tile) beside the slab and the cp.async ring; then the shipped
# kernel's copies alone / arithmetic alone at 16 rows, cold (where the 83 us of the fused gate / up go).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/T
echo probe skipped
grep -v Warn $OUT/T/probe-tma.txt | cut -c1-220 | tail -12
timeout 150 python3 -m benchmarks.matmul_variants --variants current,shifted,memonly,computeonly,skeleton --rows 16 --shapes "mlp gate+up fused;mlp down;o_proj" --cold-bytes 268435456 --json $OUT/T/split.json > $OUT/T/split.txt 2>&1; echo split rc=$?
python3 - $OUT/T/split.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(r.get("projection"), r.get("rows"), r.get("variant"), r.get("device_us"), r.get("over_bound"))
PY
cd $OUT && tar czf T.tgz T && rm -rf T
