#!/bin/bash
# session 48, call D1: direct4-nobarrier timed against the staged and direct forms (4-bit, 1 and 16 rows);
# the register-direct dense form (wdirect, built in s46, never timed) against the shipped dense form.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/D1
summ() { python3 - "$1" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for r in rows:
    print(f'{r["projection"][:26]:26} {r["rows"]:>2} {r["variant"]:18} {r["device_us"]:8.1f} us {r["over_bound"]:5.2f}x  diff {r["max_abs_diff_vs_mlx"]:.3g} same {r.get("same_bits_as_current")}')
PY
}
timeout 200 python3 -m benchmarks.matmul_variants --variants current,vecmerge,direct4,direct4-nobarrier --rows 1,16 --shapes "mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused;lm_head" --json $OUT/D1/direct.json > $OUT/D1/direct.txt 2>&1; echo variants rc=$?
summ $OUT/D1/direct.json; grep -i error $OUT/D1/direct.txt | head -5
timeout 200 python3 -m benchmarks.matmul_variants --dense --variants current,wdirect,vecmerge --rows 1,16 --json $OUT/D1/dense.json > $OUT/D1/dense.txt 2>&1; echo dense rc=$?
summ $OUT/D1/dense.json; grep -i error $OUT/D1/dense.txt | head -5
cd $OUT && tar czf D1.tgz D1 && rm -rf D1
