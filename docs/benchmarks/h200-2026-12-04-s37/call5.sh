#!/bin/bash
# session 37, call 5: the default's arms again, with the script's context start arm beside them.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
timeout 300 python3 .sweep/s37/pace.py $OUT/pace-4bit-5.json 4bit 0,4,4c,8 6 > $OUT/pace-4bit-5.txt 2>&1; echo "pace rc=$?"
grep -E "^[0-9]|summary|Error|error" $OUT/pace-4bit-5.txt | cut -c1-400
