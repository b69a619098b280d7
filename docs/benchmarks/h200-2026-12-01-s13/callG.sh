#!/bin/bash
# session 13, call G: fresh counters per launch: the merged CUDA test (three launches of one bound call evaluated together)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -m cuda -k "merged or oracle" > $OUT/pytest-cuda-fresh-counters.txt 2>&1; echo pytest rc=$?
tail -3 $OUT/pytest-cuda-fresh-counters.txt | cut -c1-300
