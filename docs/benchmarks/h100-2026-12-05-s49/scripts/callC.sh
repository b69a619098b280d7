#!/bin/bash
# session 49, call C: DFlash rounds at tau = 6, 4-bit, with both session-48 switches on (round_profile --device-time).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/C
S=${1:-1}
DFLASH_QMM_VECTOR_MERGE=$S DFLASH_QMM_DENORMAL_Q4=$S timeout 280 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --kernels default --device-time --json $OUT/C/rounds-4bit-s$S.json > $OUT/C/rounds-4bit-s$S.txt 2>&1; echo "rounds s=$S rc=$?"
grep -v -i warn $OUT/C/rounds-4bit-s$S.txt | cut -c1-260 | tail -8
cd $OUT && tar czf C$S.tgz C && rm -rf C
