#!/bin/bash
# session 51, call D1 (session 49's call D, per-call part): the paired stage and the lean issue (DFLASH_QMM_PAIRED_STAGE, DFLASH_QMM_LEAN_ISSUE;
# matmul_variants' "paired", "lean", "paired-lean") against the shipped forms, per call (4-bit with the denormal
# decode on in every arm, and bf16), then 16-row verify layers over a 4,096-row context (layer_stack --trace),
# processes alternating both switches together.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DFLASH_QMM_DENORMAL_Q4=1
mkdir -p $OUT/D1
summary() {
python3 - $1 <<'PY2'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f'{r["projection"][:22]:22} {r["rows"]:>2} {r["variant"]:12} {r["device_us"]:7.1f} us {r["over_bound"]:5.2f}x same {r.get("same_bits_as_current")}')
PY2
}
S="mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused"
timeout 200 python3 -m benchmarks.matmul_variants --variants current,paired,lean,paired-lean --rows 1,16 --shapes "$S;lm_head" --json $OUT/D1/q4.json > $OUT/D1/q4.txt 2>&1; echo q4 rc=$?; summary $OUT/D1/q4.json
timeout 120 python3 -m benchmarks.matmul_variants --dense --variants current,paired,lean,paired-lean --rows 1,16 --shapes "$S" --json $OUT/D1/dense.json > $OUT/D1/dense.txt 2>&1; echo dense rc=$?; summary $OUT/D1/dense.json
cd $OUT && tar czf D1.tgz D1 && rm -rf D1
