#!/bin/bash
# session 43, call D: device times of the shipped merge against the loop it replaced (4-bit 16 and 1 rows, 8-bit 16 rows).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-D.txt 2>&1
S="mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj"
timeout 170 python3 -m benchmarks.matmul_variants --rows 16,1 --reps 15 --variants current,mergeloop --shapes "$S" --json $OUT/D-merge-4bit.json > $OUT/D-merge-4bit.txt 2>&1; echo 4bit rc=$?
timeout 120 python3 -m benchmarks.matmul_variants --bits 8 --rows 16 --reps 15 --variants current,mergeloop --shapes "$S" --json $OUT/D-merge-8bit.json > $OUT/D-merge-8bit.txt 2>&1; echo 8bit rc=$?
python3 - <<'PY'
import json, os
for f in ("D-merge-4bit.json", "D-merge-8bit.json"):
    try:
        d = json.load(open(os.environ["OUT"] + "/" + f))
    except Exception as e:
        print(f, e); continue
    for r in d["rows"]:
        print(f'{f[8:12]} {r["rows"]:2d} {r["projection"][:22]:22s} {r["variant"]:10s} {r["device_us"]:8.2f} {r["over_bound"]:5.2f}x diff={r.get("max_abs_diff_vs_mlx")}')
    print("errors", d.get("errors"))
PY
