#!/bin/bash
# session 55, call P: where the interleaved arm's extra copies (208 a round) come from.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/P
timeout 120 python3 .sweep/s55/probe_copies.py > $OUT/P/copies.txt 2>&1; echo copies rc=$?
grep -v Warning $OUT/P/copies.txt | cut -c1-400 | head -60
timeout 300 python3 .sweep/s55/probe_kept.py --scale full --quant 4bit --context 4096 --max-tokens 48 --runs 1 --kernels default,default-interleaved --device-time --json $OUT/P/rounds.json > $OUT/P/kept.txt 2>&1; echo kept rc=$?
grep -E "KEPT|Error|error" $OUT/P/kept.txt | head -20
