#!/bin/bash
# session 37, call 3: 4-bit arms again (with the drafter started after its second layer), then bf16 with the default (kernels off).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
timeout 300 python3 .sweep/s37/pace.py $OUT/pace-4bit-3.json 4bit 0,6c,4c,6cd,6 6 > $OUT/pace-4bit-3.txt 2>&1; echo "pace rc=$?"
grep -E "^[0-9]|summary|Error|error" $OUT/pace-4bit-3.txt | cut -c1-400
timeout 250 python3 .sweep/s37/pace.py $OUT/pace-bf16-off.json bf16 0,6c,6cd 4 > $OUT/pace-bf16-off.txt 2>&1; echo "pace bf16 rc=$?"
grep -E "^[0-9]|summary|Error|error" $OUT/pace-bf16-off.txt | cut -c1-400
