#!/bin/bash
# Session 60, call 4: the head prep's and the traced drafts' cuda tests.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/T
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_head_prep.py tests/test_traced_drafts.py tests/test_prepared_heads.py -m cuda > $OUT/T/t2-drafter.txt 2>&1
echo "== t2 rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/T/t2-drafter.txt | tail -8 | cut -c1-300
