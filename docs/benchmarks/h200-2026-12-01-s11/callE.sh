#!/bin/bash
# session 11, call E: each plain token's device span and busy time (CUPTI), off vs both parts (4-bit, 4k)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TP=/opt/torch/.venv/bin/python3
timeout 300 $TP -m benchmarks.plain_phases --scale full --quant 4bit --context 4096 --tokens 64 --passes 1 --kernels off,all --device-time --json $OUT/plain-device-4bit.json > $OUT/plain-device-4bit.txt 2>&1; echo rc=$?
grep '"arm"' $OUT/plain-device-4bit.txt | grep -v extra | cut -c1-420
tail -3 $OUT/plain-device-4bit.txt | cut -c1-300
