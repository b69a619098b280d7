#!/bin/bash
# session 29, call C: where the drafter's forward goes (drafter_probe.py), and nsys if present.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
which nsys ncu > $OUT/C-tools.txt 2>&1
timeout 300 python3 .sweep/s29/drafter_probe.py $OUT/C-drafter.json 30 > $OUT/C-drafter.txt 2>&1; echo probe rc=$?; cut -c1-900 $OUT/C-drafter.txt | tail -8
