#!/bin/bash
# session 17, call C: the 8-bit Muse Glimmer candidate for the default kernel rule: rounds at tau 6, 4k, kernels off vs every part
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${R1:-420} python3 -m benchmarks.round_profile --scale full --quant 8bit --context 4096 --tau 6 --max-tokens 64 --runs 4 --kernels off,all --json $OUT/rp-8bit-4k.json > $OUT/rp-8bit-4k.txt 2>&1; echo rp rc=$?
grep "^{" $OUT/rp-8bit-4k.txt | grep -v '"rounds"' | cut -c1-240
grep '"rounds"' $OUT/rp-8bit-4k.txt | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['kernels'], r['round'], r['verify_graph'], r['verify_launch'], r['draft'], r['draft_launch'], r['wait'], r['lossless'])"
