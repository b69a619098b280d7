#!/bin/bash
# session 51, call D2 (session 49's call D, layer part): the paired stage and the lean issue (DFLASH_QMM_PAIRED_STAGE, DFLASH_QMM_LEAN_ISSUE;
# matmul_variants' "paired", "lean", "paired-lean") against the shipped forms, per call (4-bit with the denormal
# decode on in every arm, and bf16), then 16-row verify layers over a 4,096-row context (layer_stack --trace),
# processes alternating both switches together.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DFLASH_QMM_DENORMAL_Q4=1
mkdir -p $OUT/D2
summary() {
python3 - $1 <<'PY2'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f'{r["projection"][:22]:22} {r["rows"]:>2} {r["variant"]:12} {r["device_us"]:7.1f} us {r["over_bound"]:5.2f}x same {r.get("same_bits_as_current")}')
PY2
}
for p in 0 1 1 0; do
  n=$(ls $OUT/D2 | grep -c stack-p$p) 
  DFLASH_QMM_PAIRED_STAGE=$p DFLASH_QMM_LEAN_ISSUE=$p timeout 90 python3 -m benchmarks.layer_stack --quant 4bit --arms ours --layers 8 --context 4096 --trace --json $OUT/D2/stack-p$p-$n.json > $OUT/D2/stack-p$p-$n.txt 2>&1; echo "stack p=$p rc=$?"
  python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['traces']['ours']; print('busy/layer', t['busy_us_per_layer'], 'matmul', [x['us_per_layer'] for x in t['top'] if 'tensor_q4' in x['name']])" $OUT/D2/stack-p$p-$n.json
done
cd $OUT && tar czf D2.tgz D2 && rm -rf D2
