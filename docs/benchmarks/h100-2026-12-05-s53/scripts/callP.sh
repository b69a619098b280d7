#!/bin/bash
# session 53, call P: (1) the copy probe (benchmarks.copy_probe: the weights read five ways, cold);
# (2) the paired stage + lean issue's cuda tests beside the pairs in place (never run together on a device);
# (3) per call with the weights cold: current (in place), paired-lean, shifted.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/P
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > $OUT/P/gpu.txt 2>&1; cat $OUT/P/gpu.txt
timeout 100 python3 -m benchmarks.copy_probe --shapes "mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj" --forms stream,ldg-tile,cpasync-tile,bulk-tile,bulk-slab,tma-tile --json $OUT/P/probe.json > $OUT/P/probe.txt 2>&1; echo probe rc=$?
cut -c1-220 $OUT/P/probe.txt | tail -24
P="python3 -m pytest -q -p no:cacheprovider -rf"
Q=tests/test_tensor_qmm.py
SW="DFLASH_QMM_PAIRED_STAGE=1 DFLASH_QMM_LEAN_ISSUE=1"
env $SW timeout 230 $P $Q -m cuda -k "denormal or leading_shape" > $OUT/P/p1-denormal.txt 2>&1 &
env $SW timeout 230 $P $Q -m cuda -k tensor_matmul_glimmer_shapes > $OUT/P/p2-glimmer.txt 2>&1 &
env $SW timeout 230 $P tests/test_kernel_patch.py -k "agree_bitwise" > $OUT/P/p3-kernel-patch.txt 2>&1 &
wait
for f in $OUT/P/p*.txt; do echo "== $(basename $f)"; grep -E "^(FAILED|ERROR)|passed|failed|error" $f | tail -4 | cut -c1-300; done
S="mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused"
timeout 170 python3 -m benchmarks.matmul_variants --variants current,paired-lean,shifted --rows 1,16 --shapes "$S" --cold-bytes 268435456 --json $OUT/P/q4-cold.json > $OUT/P/q4-cold.txt 2>&1; echo q4 rc=$?
python3 - $OUT/P/q4-cold.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["meta"].get("device"), d["meta"].get("bandwidth"))
for r in d["rows"]:
    print({k: r.get(k) for k in ("shape", "rows", "variant", "device_us", "over_bound", "same_bits_as_current")})
PY
cd $OUT && tar czf P.tgz P && rm -rf P
