#!/bin/bash
# session 37, call 7: the last gap's layers only (t2: 41, 45; t3: 40, 43, 46; both with the context append started), against 0, 4 and the context alone.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
lscpu | grep -E "Model name" | head -1
timeout 320 python3 .sweep/s37/pace.py $OUT/pace-4bit-7.json 4bit 0,4,t2,t3,0c 5 > $OUT/pace-4bit-7.txt 2>&1; echo "pace rc=$?"
grep -E "^[0-9]|summary|Error|error" $OUT/pace-4bit-7.txt | cut -c1-700
