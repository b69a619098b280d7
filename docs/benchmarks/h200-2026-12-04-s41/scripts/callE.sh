#!/bin/bash
# session 41, call E: the wave rule's fixed cost at 8 bits (gate+up, the only Glimmer shape it changes), the epilogue taken apart (4-bit), then the pacing arms with an A/A control on the new rule.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 100 python3 -m benchmarks.matmul_variants --bits 8 --rows 16,1 --reps 30 --variants current,overhead2 --shapes "mlp gate+up fused" --json $OUT/E-variants8.json > $OUT/E-variants8.txt 2>&1; echo v8 rc=$?
timeout 150 python3 -m benchmarks.matmul_variants --rows 16,1 --reps 30 --variants current,overhead2,noepilogue,nolast,nolast-nofence,unmerged --shapes "mlp down;o_proj;mlp gate+up fused" --json $OUT/E-epilogue.json > $OUT/E-epilogue.txt 2>&1; echo ve rc=$?
python3 - <<'PY'
import json, os
for f in ("E-variants8.json", "E-epilogue.json"):
    d = json.load(open(os.environ["OUT"] + "/" + f))
    for r in d["rows"]:
        print(f'{d["meta"]["bits"]} {r["rows"]:2d} {r["projection"][:18]:18s} {r["variant"]:15s} {r["device_us"]:8.2f} {r["over_bound"]:5.2f}x k={r["kernels_per_call"]:.2f} d={r["max_abs_diff_vs_mlx"]}')
    print("errors", d.get("errors"))
PY
timeout 330 python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms 0,auto,4,4/b --reps 6 --json $OUT/E-pacing_aa.json 2>&1 | grep -v Warning | tail -30
