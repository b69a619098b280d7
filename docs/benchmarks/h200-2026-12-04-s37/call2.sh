#!/bin/bash
# session 37, call 2: more DFLASH_EVAL_EVERY arms (4-bit), then bf16 with the verify kernels on and off.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
timeout 300 python3 .sweep/s37/pace.py $OUT/pace-4bit-2.json 4bit 0,4c,6c,0c,3c 6 > $OUT/pace-4bit-2.txt 2>&1; echo "pace rc=$?"
grep -E "^[0-9]|summary|Error|error" $OUT/pace-4bit-2.txt | cut -c1-400
DFLASH_VERIFY_KERNELS=1 timeout 250 python3 .sweep/s37/pace.py $OUT/pace-bf16-on.json bf16 0,4c,4 4 > $OUT/pace-bf16-on.txt 2>&1; echo "pace bf16 rc=$?"
grep -E "^[0-9]|summary|Error|error" $OUT/pace-bf16-on.txt | cut -c1-400
