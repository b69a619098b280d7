#!/bin/bash
# session 16, call F: more pairs for the held norm scales: bf16 rounds off-unheld vs off (8 runs each), 4-bit rounds default-unheld vs default (4 runs each), tau 6, 4k
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
show() { grep "^{" $1 | grep -v '"rounds"' | cut -c1-240; grep '"rounds"' $1 | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['kernels'], r['round'], r['verify_graph'], r['verify_launch'], r['draft_launch'], r['wait'], r['lossless'])"; }
timeout ${R1:-200} python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 6 --max-tokens 64 --runs 8 --kernels off-unheld,off --json $OUT/rp-bf16-4k-held8.json > $OUT/rp-bf16-4k-held8.txt 2>&1; echo rp-bf16 rc=$?
show $OUT/rp-bf16-4k-held8.txt
timeout ${R2:-250} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 4 --kernels default-unheld,default --json $OUT/rp-4bit-4k-held4.json > $OUT/rp-4bit-4k-held4.txt 2>&1; echo rp-4bit rc=$?
show $OUT/rp-4bit-4k-held4.txt
