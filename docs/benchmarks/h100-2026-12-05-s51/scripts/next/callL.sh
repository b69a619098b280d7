#!/bin/bash
# For the next lease (written in session 51, not yet run): the denormal decode's pairs in place
# (DFLASH_QMM_DENORMAL_IN_PLACE; matmul_variants' denorm04: 4 LOP3 + 1 SHF a weight word instead of 4 + 4; by
# the SASS census the chunk loop's tail 338 -> 298 instructions a warp at one m-tile, 409 -> 369 at two) against
# the shipped form, per call at 1, 16 and 32 rows (the same-bits column checks it on the device: the benchmark
# weights' scales ~0.005 are below its bfloat16 limit of 2^-5); then whole rounds, default against
# default-inplace in one process (the default arm twice, an A/A control).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/L
S="mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused;lm_head"
timeout 200 python3 -m benchmarks.matmul_variants --variants current,denorm04 --rows 1,16,32 --shapes "$S" --json $OUT/L/q4.json > $OUT/L/q4.txt 2>&1; echo q4 rc=$?
python3 - $OUT/L/q4.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f'{r["projection"][:22]:22} {r["rows"]:>2} {r["variant"]:10} {r["device_us"]:7.1f} us {r["over_bound"]:5.2f}x same {r.get("same_bits_as_current")}')
PY
timeout 330 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --kernels default,default-inplace,default --device-time --json $OUT/L/rounds.json > $OUT/L/rounds.txt 2>&1; echo "rounds rc=$?"
grep -v -i warn $OUT/L/rounds.txt | grep '"dflash tau' | cut -c1-160
cd $OUT && tar czf L.tgz L && rm -rf L
