#!/bin/bash
# session 42, call F (graphs on, as shipped): the merge with every split's load of an output in flight (mergeunrolled) -- bits against
# the shipped merge, then device times beside the shipped merge, session 41's batched merge and no merge at all (nolast, diagnostic).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 70 python3 .sweep/s42/bits_merge.py > $OUT/F-bits-merge.txt 2>&1; echo bits rc=$?; tail -1 $OUT/F-bits-merge.txt
S="mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj"
timeout 150 python3 -m benchmarks.matmul_variants --rows 16,1 --reps 15 --variants current,mergeunrolled,batchedmerge,nolast --shapes "$S" --json $OUT/F-merge.json > $OUT/F-merge.txt 2>&1; echo v rc=$?
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/F-merge.json"))
for r in d["rows"]:
    print(f'{r["rows"]:2d} {r["projection"][:22]:22s} {r["variant"]:14s} {r["device_us"]:8.2f} {r["over_bound"]:5.2f}x diff={r.get("max_abs_diff_vs_mlx")}')
print("errors", d.get("errors"))
PY
