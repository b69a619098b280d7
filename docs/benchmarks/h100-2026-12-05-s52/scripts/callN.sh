#!/bin/bash
# session 52, call N: the pairs in place and the paired stage + lean issue per call (matmul_variants current vs
# denorm04 vs paired-lean, 1 / 16 / 32 rows, with the device's same-bits check), weights cold (copies spanning
# 256 MB, past the L2) and warm (the same weights every call).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/N
S="mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused;lm_head"
for MODE in cold warm; do
C=0; [ $MODE = cold ] && C=268435456
timeout 160 python3 -m benchmarks.matmul_variants --variants current,denorm04,paired-lean --rows 1,16,32 --shapes "$S" --cold-bytes $C --json $OUT/N/q4-$MODE.json > $OUT/N/q4-$MODE.txt 2>&1; echo q4 $MODE rc=$?
python3 - $OUT/N/q4-$MODE.json <<'PY2'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f'{r["projection"][:22]:22} {r["rows"]:>2} {r["variant"]:11} {r["device_us"]:7.1f} us {r["over_bound"]:5.2f}x same {r.get("same_bits_as_current")} copies {r.get("weight_copies")}')
PY2
done
cd $OUT && tar czf N.tgz N && rm -rf N
