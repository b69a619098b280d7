#!/bin/bash
# session 37, call 8: t2 and the context alone against 0 again (same machine as call 7).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
lscpu | grep -E "Model name" | head -1
timeout 200 python3 .sweep/s37/pace.py $OUT/pace-4bit-8.json 4bit 0,t2,0c 6 > $OUT/pace-4bit-8.txt 2>&1; echo "pace rc=$?"
grep -E "^[0-9]|summary|Error|error" $OUT/pace-4bit-8.txt | cut -c1-700
