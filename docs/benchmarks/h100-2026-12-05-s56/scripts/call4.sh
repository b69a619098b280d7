#!/bin/bash
# Session 56, call 4: interleaved scales' cuda tests (s55 callA) beside the persistent
# matmul's cuda tests.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/C
P="python3 -m pytest -q -p no:cacheprovider -rf"
timeout 250 $P tests/test_tensor_persistent.py -m cuda > $OUT/C/c1-tests.txt 2>&1 &
bash .sweep/s56/callA.sh
wait
echo "== c1-tests.txt"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/C/c1-tests.txt | tail -6 | cut -c1-300
