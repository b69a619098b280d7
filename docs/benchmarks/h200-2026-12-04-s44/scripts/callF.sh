#!/bin/bash
# session 44, call F (run inline as this command): session 29's drafter probe (full 4-bit pair, 4k) on this
# tree; the probe is docs/benchmarks/h200-2026-12-03-s29/drafter_probe.py, carried as .sweep/s44/drafter_probe.py.
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1; mkdir -p $OUT
timeout 150 python3 .sweep/s44/drafter_probe.py $OUT/F-drafter.json 20 > $OUT/F-drafter.txt 2>&1; echo probe rc=$?
