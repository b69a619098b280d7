#!/bin/bash
# session 47, call D1: the direct 4-bit matmul's cuda tests, then per-call device time against the staged form.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/D1
timeout 240 python3 -m pytest -q -p no:cacheprovider -x -m cuda tests/test_tensor_direct.py > $OUT/D1/tests-direct.txt 2>&1; echo tests rc=$?; tail -4 $OUT/D1/tests-direct.txt
timeout 300 python3 -m benchmarks.matmul_variants --variants current,direct4,direct4-noahead,direct4-nc --rows 1,16 --shapes "mlp gate / up;mlp down;q_proj / gate_proj (attn);o_proj;attn q/k/v/gate fused;mlp gate+up fused;lm_head" --json $OUT/D1/direct.json > $OUT/D1/direct.txt 2>&1; echo variants rc=$?
python3 - <<'PY'
import json, os
rows = json.load(open(os.environ["OUT"] + "/D1/direct.json"))["rows"]
for r in rows:
    print(f'{r["projection"][:26]:26} {r["rows"]:>2} {r["variant"]:16} {r["device_us"]:8.1f} us {r["over_bound"]:5.2f}x  diff {r["max_abs_diff_vs_mlx"]:.3g}')
PY
grep -i error $OUT/D1/direct.txt | head -5
cd $OUT && tar czf D1.tgz D1 && rm -rf D1
