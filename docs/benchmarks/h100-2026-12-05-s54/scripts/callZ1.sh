#!/bin/bash
# session 54, call Z1: chunk-major scales (DFLASH_QMM_CHUNK_MAJOR_SCALES=1, the forms read at import): their cuda
# tests, then per call with the weights cold against the default, the address diagnostic and noscales.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/Z1
P="python3 -m pytest -q -p no:cacheprovider -rf"
Q=tests/test_tensor_qmm.py
E="env DFLASH_QMM_CHUNK_MAJOR_SCALES=1"
$E timeout 230 $P $Q -m cuda -k "denormal or leading_shape" > $OUT/Z1/z1-denormal.txt 2>&1 &
$E timeout 230 $P $Q -m cuda -k tensor_matmul_glimmer_shapes > $OUT/Z1/z2-glimmer.txt 2>&1 &
$E timeout 230 $P tests/test_kernel_patch.py -k "agree_bitwise" > $OUT/Z1/z3-kernel-patch.txt 2>&1 &
wait
for f in $OUT/Z1/z*.txt; do echo "== $(basename $f)"; grep -E "^(FAILED|ERROR)|passed|failed|error" $f | tail -4 | cut -c1-300; done
S="mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused;lm_head"
timeout 200 python3 -m benchmarks.matmul_variants --variants current,cmajor,shifted,contigscales,noscales --rows 1,16 --shapes "$S" --cold-bytes 268435456 --json $OUT/Z1/cmajor-cold.json > $OUT/Z1/cmajor-cold.txt 2>&1; echo q4 rc=$?
python3 - $OUT/Z1/cmajor-cold.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(r["projection"], r["rows"], r["variant"], r["device_us"], r["over_bound"], r.get("same_bits_as_current"))
PY
cd $OUT && tar czf Z1.tgz Z1 && rm -rf Z1
