#!/bin/bash
# session 24, call B: encode cost vs kernel source length; plain decoding with the kernels (traced / untraced) vs off; rounds at 4k traced vs untraced
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
cp .sweep/s24/hashcost.py .sweep/s24/callB.sh $OUT/
timeout 60 python3 .sweep/s24/hashcost.py > $OUT/B-hashcost.txt 2>&1; echo hash rc=$?; cat $OUT/B-hashcost.txt | tail -12
timeout ${T2:-220} python3 -m benchmarks.plain_phases --scale full --quant 4bit --context 4096 --tokens 40 --passes 2 --kernels off,all,all-untraced --json $OUT/B-plain-phases.json > $OUT/B-plain-phases.txt 2>&1; echo pp rc=$?; grep "^{" $OUT/B-plain-phases.txt | cut -c1-400 | tail -12
timeout ${T3:-240} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 3 --kernels default,default-untraced --json $OUT/B-rp-4k.json > $OUT/B-rp-4k.txt 2>&1; echo rp rc=$?; grep "^{" $OUT/B-rp-4k.txt | cut -c1-300 | tail -8
