#!/bin/bash
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/S
timeout 300 python3 .sweep/s55/probe_seq.py --scale full --quant 4bit --context 4096 --max-tokens 48 --runs 1 --kernels default,default-interleaved --device-time --json $OUT/S/rounds.json > $OUT/S/seq.txt 2>&1; echo seq rc=$?
grep -A9 CAPTURE $OUT/S/seq.txt | cut -c1-220 | head -120
