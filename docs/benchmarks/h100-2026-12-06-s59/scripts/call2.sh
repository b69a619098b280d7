#!/bin/bash
# Session 59: the L2 prefetch probe (a gap kernel asks the L2 for the next matmul's weights).
# Usage: call2.sh TAG "SHAPES" [extra args]
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/P
nvidia-smi --query-gpu=name --format=csv,noheader
TAG=$1; SHAPES=$2; shift 2
timeout 280 python3 -m benchmarks.l2_prefetch --shapes "$SHAPES" --gaps 6,15 --reps 30 "$@" --json $OUT/P/l2-$TAG.json > $OUT/P/l2-$TAG.txt 2>&1
echo "rc=$?"
grep -v Warning $OUT/P/l2-$TAG.txt | python3 -c '
import sys, json
for line in sys.stdin:
    try: r = json.loads(line)
    except Exception: print(line.rstrip()[:300]); continue
    print(r.get("shape","")[:12], r.get("gap_us"), r.get("arm"), r.get("method"), r.get("placement"), r.get("asked_mb"), "mm", r.get("matmul_device_us"), "gap", r.get("gap_device_us"), "pair", r.get("pair_device_us"), r.get("same_bits"))
'
