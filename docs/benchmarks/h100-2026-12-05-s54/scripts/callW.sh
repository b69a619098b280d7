#!/bin/bash
# For the next lease (written in session 53, not yet run): unit scales (DFLASH_QMM_UNIT_SCALES=1, opt-in) on the
# device. Its cuda tests first (the switch is read at import: the forms' texts are built with it), then per call
# with the weights cold against the default and noscales (the copies' floor), then whole rounds with the
# steady-state trace, the default twice as an A/A control.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/W
P="python3 -m pytest -q -p no:cacheprovider -rf"
Q=tests/test_tensor_qmm.py
env DFLASH_QMM_UNIT_SCALES=1 timeout 230 $P $Q -m cuda -k "denormal or leading_shape" > $OUT/W/w1-denormal.txt 2>&1 &
env DFLASH_QMM_UNIT_SCALES=1 timeout 230 $P $Q -m cuda -k tensor_matmul_glimmer_shapes > $OUT/W/w2-glimmer.txt 2>&1 &
env DFLASH_QMM_UNIT_SCALES=1 timeout 230 $P tests/test_kernel_patch.py -k "agree_bitwise" > $OUT/W/w3-kernel-patch.txt 2>&1 &
wait
for f in $OUT/W/w*.txt; do echo "== $(basename $f)"; grep -E "^(FAILED|ERROR)|passed|failed|error" $f | tail -4 | cut -c1-300; done
S="mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused"
timeout 170 python3 -m benchmarks.matmul_variants --variants current,unit,noscales --rows 1,16 --shapes "$S" --cold-bytes 268435456 --json $OUT/W/unit-cold.json > $OUT/W/unit-cold.txt 2>&1; echo q4 rc=$?
python3 - $OUT/W/unit-cold.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(r["projection"], r["rows"], r["variant"], r["device_us"], r["over_bound"], r.get("same_bits_as_current"))
PY
cd $OUT && tar czf W.tgz W && rm -rf W
