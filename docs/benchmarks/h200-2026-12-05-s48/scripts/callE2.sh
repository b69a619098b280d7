#!/bin/bash
# session 48, call E2: device time of a round (4k, tau 6, round_profile --device-time) with the vector merge
# (DFLASH_QMM_VECTOR_MERGE=1) against the shipped merge, processes alternating; bf16 with each once.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/E2
i=0
for spec in 4bit:1 4bit:0 4bit:1; do  # as run (cut from six by a sed in the call)
  i=$((i + 1)); q=${spec%:*}; v=${spec#*:}
  f=$OUT/E2/rounds-$i-$q-vector$v
  DFLASH_QMM_VECTOR_MERGE=$v timeout 85 python3 -m benchmarks.round_profile --scale full --quant $q --context 4096 --max-tokens 64 --kernels default --device-time --json $f.json > $f.txt 2>&1; echo rounds $i $q vector=$v rc=$?
  grep -h '"busy_ms"' $f.txt | python3 -c "import sys,json; [print(' ', json.loads(l)['run'], json.loads(l)['busy_ms']) for l in sys.stdin if l.startswith('{')]"
done
cd $OUT && tar czf E2.tgz E2 && rm -rf E2
