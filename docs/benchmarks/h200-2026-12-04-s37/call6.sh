#!/bin/bash
# session 37, call 6: the host's launch and judge time a run, arms 0 and 4 (4-bit); the host's CPU.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
lscpu | grep -E "Model name|MHz" | head -3
timeout 250 python3 .sweep/s37/pace.py $OUT/pace-4bit-6.json 4bit 0,4 5 > $OUT/pace-4bit-6.txt 2>&1; echo "pace rc=$?"
grep -E "^[0-9]|summary|Error|error" $OUT/pace-4bit-6.txt | cut -c1-500
