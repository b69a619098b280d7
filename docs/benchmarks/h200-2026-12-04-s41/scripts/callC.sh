#!/bin/bash
# session 41, call C: the fixed cost of a matmul launch taken apart (empty, prologue, skeleton, no epilogue), and the wave rule with a larger fixed cost.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
V=current,empty,prologue,skeleton,noepilogue,overhead4,overhead20,waves132
timeout 300 python3 -m benchmarks.matmul_variants --rows 16 --reps 20 --variants $V --shapes "mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj" --json $OUT/C-variants16.json > $OUT/C-variants16.txt 2>&1; echo variants rc=$?
timeout 120 python3 -m benchmarks.matmul_variants --rows 1 --reps 20 --variants current,overhead4,overhead20 --shapes "mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj" --json $OUT/C-variants1.json > $OUT/C-variants1.txt 2>&1; echo variants1 rc=$?
python3 - <<'PY'
import json, os
for f in ("C-variants16.json", "C-variants1.json"):
    d = json.load(open(os.environ["OUT"] + "/" + f))
    for r in d["rows"]:
        print(f'{r["rows"]:2d} {r["projection"][:22]:22s} {r["variant"]:14s} {r["device_us"]:8.2f} {r["over_bound"]:5.2f}x k={r["kernels_per_call"]}')
    print("errors", d.get("errors"))
PY
