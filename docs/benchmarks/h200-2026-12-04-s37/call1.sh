#!/bin/bash
# session 37, call 1: DFLASH_EVAL_EVERY arms in one process (4-bit), then the CUDA traced-layer tests.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
timeout 400 python3 .sweep/s37/pace.py $OUT/pace-4bit-1.json 4bit 0,4,2,4c 6 > $OUT/pace-4bit-1.txt 2>&1; echo "pace rc=$?"
grep -vE "^\s*$" $OUT/pace-4bit-1.txt | grep -E "^[0-9]|summary|Error|error" | cut -c1-400
timeout 180 python3 -m pytest -q -p no:cacheprovider -x -m cuda tests/test_traced_layers.py > $OUT/cuda-traced.txt 2>&1; echo "pytest rc=$?"
tail -5 $OUT/cuda-traced.txt
