#!/bin/bash
# session 51, call H: DFlash rounds at tau = 6, 4-bit (round_profile --device-time), denormal decode on; the paired
# stage alone, then the lean issue alone.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DFLASH_QMM_DENORMAL_Q4=1
mkdir -p $OUT/H
for PL in 10 01; do
DFLASH_QMM_PAIRED_STAGE=${PL:0:1} DFLASH_QMM_LEAN_ISSUE=${PL:1:1} timeout 230 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --kernels default --device-time --json $OUT/H/rounds-4bit-pl$PL.json > $OUT/H/rounds-4bit-pl$PL.txt 2>&1; echo "rounds pl=$PL rc=$?"
grep -v -i warn $OUT/H/rounds-4bit-pl$PL.txt | cut -c1-200 | tail -3
done
cd $OUT && tar czf H.tgz H && rm -rf H
