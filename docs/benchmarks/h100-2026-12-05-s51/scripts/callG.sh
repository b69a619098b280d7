#!/bin/bash
# session 51, call G: DFlash rounds at tau = 6, 4-bit (round_profile --device-time), the denormal decode on in both
# processes; the paired stage and the lean issue on ($1=1) or off ($1=0).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DFLASH_QMM_DENORMAL_Q4=1
mkdir -p $OUT/G
for S in "$@"; do
DFLASH_QMM_PAIRED_STAGE=$S DFLASH_QMM_LEAN_ISSUE=$S timeout 250 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --kernels default --device-time --json $OUT/G/rounds-4bit-pl$S.json > $OUT/G/rounds-4bit-pl$S.txt 2>&1; echo "rounds pl=$S rc=$?"
grep -v -i warn $OUT/G/rounds-4bit-pl$S.txt | cut -c1-200 | tail -6
done
cd $OUT && tar czf G.tgz G && rm -rf G
