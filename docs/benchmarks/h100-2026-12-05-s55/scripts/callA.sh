#!/bin/bash
# Session 55, call A (written in session 54): interleaved scales (DFLASH_QMM_INTERLEAVED_SCALES=1, opt-in, read at import) on the device; a5 added in session 55.
# Their cuda tests first, then per call with the weights cold against the
# default (chunk-major scales) and noscales (the copies' floor).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/A
P="python3 -m pytest -q -p no:cacheprovider -rf"
Q=tests/test_tensor_qmm.py
E="env DFLASH_QMM_INTERLEAVED_SCALES=1"
$E timeout 230 $P $Q -m cuda -k "denormal or leading_shape" > $OUT/A/a1-denormal.txt 2>&1 &
$E timeout 230 $P $Q -m cuda -k tensor_matmul_glimmer_shapes > $OUT/A/a2-glimmer.txt 2>&1 &
($E timeout 110 $P tests/test_kernel_patch.py -k "agree_bitwise" > $OUT/A/a3-kernel-patch.txt 2>&1; $E timeout 115 $P tests/test_gated_mlp.py -m cuda -k "swiglu_form_gives_mlxs_bits" > $OUT/A/a4-swiglu.txt 2>&1) &
DFLASH_QMM_TWO_K_GROUPS=0 timeout 230 $P $Q -m cuda -k "denormal" > $OUT/A/a5-denormal-k1-default.txt 2>&1 &
wait
for f in $OUT/A/a*.txt; do echo "== $(basename $f)"; grep -E "^(FAILED|ERROR)|passed|failed|error" $f | tail -4 | cut -c1-300; done
S="mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused;lm_head"
timeout 200 python3 -m benchmarks.matmul_variants --variants current,interleaved,noscales --rows 1,16 --shapes "$S" --cold-bytes 268435456 --json $OUT/A/interleaved-cold.json > $OUT/A/interleaved-cold.txt 2>&1; echo q4 rc=$?
python3 - $OUT/A/interleaved-cold.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(r["projection"], r["rows"], r["variant"], r["device_us"], r["over_bound"], r.get("same_bits_as_current"))
PY
