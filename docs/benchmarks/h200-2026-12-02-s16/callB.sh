#!/bin/bash
# session 16, call B: held norm scales (dflash.held_norms) on the H200: GPU tests, DFlash rounds at tau 6 and plain tokens, held vs unheld, 4-bit 4k
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${T1:-150} python3 -m pytest -q -p no:cacheprovider tests/test_held_norms.py tests/test_kernel_patch.py -k "held or bitwise" > $OUT/pytest-held.txt 2>&1; echo pytest rc=$?
tail -3 $OUT/pytest-held.txt
timeout ${R1:-300} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 3 --kernels off-unheld,off,default-unheld,default --json $OUT/rp-4bit-4k-held.json > $OUT/rp-4bit-4k-held.txt 2>&1; echo rp rc=$?
grep "^{" $OUT/rp-4bit-4k-held.txt | grep -v '"rounds"' | cut -c1-240
grep '"rounds"' $OUT/rp-4bit-4k-held.txt | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['kernels'], r['round'], r['verify_graph'], r['verify_launch'], r['draft_launch'], r['wait'], r['lossless'])"
timeout ${PP:-140} python3 -m benchmarks.plain_phases --scale full --quant 4bit --context 4096 --tokens 40 --passes 2 --kernels off-unheld,off --json $OUT/plain-phases-held.json > $OUT/plain-phases-held.txt 2>&1; echo pp rc=$?
grep -E "^\{" $OUT/plain-phases-held.txt | cut -c1-220 | tail -8
