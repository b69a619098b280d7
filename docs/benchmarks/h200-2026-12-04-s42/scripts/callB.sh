#!/bin/bash
# session 42, call B: the cluster sum's bits against the merge's, then its device time (matmul_variants).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 150 python3 .sweep/s42/bits.py > $OUT/B-bits.txt 2>&1; echo bits rc=$?
tail -3 $OUT/B-bits.txt; grep -c "same=True" $OUT/B-bits.txt; head -2 $OUT/B-bits.txt
S="mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj"
timeout 200 python3 -m benchmarks.matmul_variants --rows 16 --reps 20 --variants current,cluster,cluster-overhead3,cluster-overhead2,noepilogue --shapes "$S" --json $OUT/B-variants16.json > $OUT/B-variants16.txt 2>&1; echo v16 rc=$?
timeout 120 python3 -m benchmarks.matmul_variants --rows 1 --reps 20 --variants current,cluster,cluster-overhead3 --shapes "$S" --json $OUT/B-variants1.json > $OUT/B-variants1.txt 2>&1; echo v1 rc=$?
python3 - <<'PY'
import json, os
for f in ("B-variants16.json", "B-variants1.json"):
    try:
        d = json.load(open(os.environ["OUT"] + "/" + f))
    except Exception as e:
        print(f, e); continue
    for r in d["rows"]:
        print(f'{r["rows"]:2d} {r["projection"][:22]:22s} {r["variant"]:18s} {r["device_us"]:8.2f} {r["over_bound"]:5.2f}x k={r["kernels_per_call"]}')
    print("errors", d.get("errors"))
PY
tail -5 $OUT/B-variants16.txt
