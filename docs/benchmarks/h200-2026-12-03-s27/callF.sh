#!/bin/bash
# session 27, call F: the traced-layer cuda tests failed with the scaled form the default (call D2): repeatability
# of eager and traced verify runs with the form on and off, then the failing tests with their messages.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
cp .sweep/s26/diagF.py $OUT/
timeout 200 python3 .sweep/s26/diagF.py 1,0 > $OUT/F-diag.txt 2>&1; echo diag rc=$?; cat $OUT/F-diag.txt | cut -c1-400 | tail -20
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_traced_layers.py -m cuda > $OUT/F-pytest-traced.txt 2>&1; echo pytest rc=$?; grep -E "Error|assert|differs|passed|failed" $OUT/F-pytest-traced.txt | cut -c1-300 | tail -20
