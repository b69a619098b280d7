#!/bin/bash
# session 24, call A: where a traced verify layer's build goes; plain decoding with the kernels (traced / untraced) vs off; rounds at 32k traced vs untraced
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
cp .sweep/s24/prof.py $OUT/prof.py
timeout ${T1:-120} python3 .sweep/s24/prof.py > $OUT/A-prof.txt 2>&1; echo prof rc=$?; head -4 $OUT/A-prof.txt | cut -c1-400; sed -n 5,30p $OUT/A-prof.txt | cut -c1-160
timeout ${T2:-200} python3 -m benchmarks.plain_phases --scale full --quant 4bit --context 4096 --tokens 40 --passes 2 --kernels off,all,all-untraced --json $OUT/A-plain-phases.json > $OUT/A-plain-phases.txt 2>&1; echo pp rc=$?; grep "^{" $OUT/A-plain-phases.txt | cut -c1-300 | tail -12
timeout ${T3:-260} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 32768 --tau 6 --max-tokens 64 --runs 2 --kernels default,default-untraced --json $OUT/A-rp-32k.json > $OUT/A-rp-32k.txt 2>&1; echo rp rc=$?; grep "^{" $OUT/A-rp-32k.txt | cut -c1-300 | tail -8
