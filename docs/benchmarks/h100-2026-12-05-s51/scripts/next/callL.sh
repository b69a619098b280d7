#!/bin/bash
# For the next lease (written in session 51, not yet run): matmul_variants' denorm04 (the denormal decode with
# the nibble pairs left in place: 4 LOP3 + 1 SHF a weight word instead of 4 + 4; by the SASS census the chunk
# loop's tail 338 -> 298 instructions a warp at one m-tile, 409 -> 369 at two) against the shipped form, per
# call at 1, 16 and 32 rows; the same-bits column checks it on the device (benchmark weights' scales ~0.005,
# below its bfloat16 limit of 2^-5).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/L
S="mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused;lm_head"
timeout 300 python3 -m benchmarks.matmul_variants --variants current,denorm04 --rows 1,16,32 --shapes "$S" --json $OUT/L/q4.json > $OUT/L/q4.txt 2>&1; echo q4 rc=$?
python3 - $OUT/L/q4.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f'{r["projection"][:22]:22} {r["rows"]:>2} {r["variant"]:10} {r["device_us"]:7.1f} us {r["over_bound"]:5.2f}x same {r.get("same_bits_as_current")}')
PY
cd $OUT && tar czf L.tgz L && rm -rf L
