#!/bin/bash
# session 24, call C: encode cost vs source length; plain decoding 4-bit off vs all (traced) over more passes; bf16 rounds and plain with the kernels (traced) vs off; side by side 4-bit 4k
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
cp .sweep/s24/hashcost.py .sweep/s24/callC.sh $OUT/
timeout 60 python3 .sweep/s24/hashcost.py > $OUT/C-hashcost.txt 2>&1; echo hash rc=$?; cat $OUT/C-hashcost.txt | tail -12
timeout ${T2:-150} python3 -m benchmarks.plain_phases --scale full --quant 4bit --context 4096 --tokens 40 --passes 4 --kernels off,all --difference --json $OUT/C-plain-4bit.json > $OUT/C-plain-4bit.txt 2>&1; echo pp4 rc=$?; grep "^{" $OUT/C-plain-4bit.txt | cut -c1-260 | tail -12
timeout ${T3:-170} python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 6 --max-tokens 64 --runs 3 --kernels off,all --json $OUT/C-rp-bf16.json > $OUT/C-rp-bf16.txt 2>&1; echo rpbf rc=$?; grep "^{" $OUT/C-rp-bf16.txt | cut -c1-300 | tail -8
timeout ${T4:-120} python3 -m benchmarks.plain_phases --scale full --quant bf16 --context 4096 --tokens 40 --passes 2 --kernels off,all --json $OUT/C-plain-bf16.json > $OUT/C-plain-bf16.txt 2>&1; echo ppbf rc=$?; grep "^{" $OUT/C-plain-bf16.txt | cut -c1-260 | tail -8
