#!/bin/bash
# Session 60, call 1: the carried prefetch's cuda test (bits), then the probe.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/T $OUT/P
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 -m pytest -q -p no:cacheprovider -rf tests/test_prefetch.py -m cuda > $OUT/T/t1-carried.txt 2>&1
echo "== t1"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/T/t1-carried.txt | tail -6 | cut -c1-300
timeout ${PROBE_S:-250} python3 -m benchmarks.carried_prefetch --fetchers 32,64 "$@" --json $OUT/P/carried-A.json > $OUT/P/carried-A.txt 2>&1
echo "probe rc=$?"
grep -v Warning $OUT/P/carried-A.txt | python3 -c '
import sys, json
for line in sys.stdin:
    try: r = json.loads(line)
    except Exception: print(line.rstrip()[:300]); continue
    print(r["pair"], r["rows"], r["fetchers"], r["arm"], "carrier", r["carrier_device_us"], "gap", r["gap_device_us"], "target", r["target_device_us"], "sum", r["sum_device_us"], r["pairs_timed"], r["same_bits"])
'
