#!/bin/bash
# session 37, call 4: the new default (DFLASH_EVAL_EVERY unset: 4 and the context append started) against 0, 4-bit; then every CUDA test.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
timeout 330 python3 .sweep/s37/pace.py $OUT/pace-4bit-4.json 4bit 0,4 8 > $OUT/pace-4bit-4.txt 2>&1; echo "pace rc=$?"
grep -E "^[0-9]|summary|Error|error" $OUT/pace-4bit-4.txt | cut -c1-400
timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda tests/ > $OUT/cuda-all.txt 2>&1; echo "pytest rc=$?"
tail -4 $OUT/cuda-all.txt
