#!/bin/bash
# session 16, call E: held norm scales in bf16 (no verify kernels by default there): DFlash rounds at tau 6, off-unheld vs off, 4k
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${R1:-330} python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 6 --max-tokens 64 --runs 3 --kernels off-unheld,off --json $OUT/rp-bf16-4k-held.json > $OUT/rp-bf16-4k-held.txt 2>&1; echo rp rc=$?
grep "^{" $OUT/rp-bf16-4k-held.txt | grep -v '"rounds"' | cut -c1-240
grep '"rounds"' $OUT/rp-bf16-4k-held.txt | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['kernels'], r['round'], r['verify_graph'], r['verify_launch'], r['draft_launch'], r['wait'], r['lossless'])"
