#!/bin/bash
# session 17, call A: what compiling whole decoder layers saves on the H200's host (probe), then a longer A/B of compiled MLP blocks (round_profile default vs default-blocked, 4-bit 4k, tau 6)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${P1:-120} python3 .sweep/s17/layer_compile.py --geometry full --quant 4bit --layers 8 --forwards 40 --passes 5 --json $OUT/layer-compile-4bit.json > $OUT/layer-compile-4bit.txt 2>&1; echo probe rc=$?
cat $OUT/layer-compile-4bit.txt | grep -v INFO
timeout ${R1:-330} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 5 --kernels default,default-blocked --json $OUT/rp-4bit-4k-blocks.json > $OUT/rp-4bit-4k-blocks.txt 2>&1; echo rp rc=$?
grep "^{" $OUT/rp-4bit-4k-blocks.txt | grep -v '"rounds"' | cut -c1-240
grep '"rounds"' $OUT/rp-4bit-4k-blocks.txt | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['kernels'], r['round'], r['verify_graph'], r['verify_launch'], r['draft'], r['draft_launch'], r['wait'], r['lossless'])"
