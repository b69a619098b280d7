#!/bin/bash
# Session 61, call 3: the round's host split (round_profile, no CUPTI) alternated by tree.
# Usage: call3.sh "N O N O"
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/R
ROOT=$PWD
i=0
for arm in $1; do
  i=$((i+1))
  envs=""; dir=$ROOT
  case $arm in
    O) dir=$ROOT/.sweep/s61/old ;;
    S) envs="DFLASH_SWIGLU=1" ;;
  esac
  (cd $dir && env PYTHONPATH=$dir:/tmp/site $envs timeout ${PER:-150} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --runs 3 --kernels default --json $OUT/R/rounds-$i-$arm.json > $OUT/R/rounds-$i-$arm.txt 2>&1)
  echo "$i $arm rc=$? $(grep -v Warning $OUT/R/rounds-$i-$arm.txt | grep -E '"runs"|round_median' | tail -1 | cut -c1-200)"
  grep -v Warning $OUT/R/rounds-$i-$arm.txt | grep '"verify_graph"' | python3 -c '
import sys, json
for l in sys.stdin:
    try: r=json.loads(l)
    except Exception: continue
    print("   round", r.get("round"), "verify_graph", r.get("verify_graph"), "host", r.get("host_not_waiting"), "wait", r.get("wait"), "draft_launch", r.get("draft_launch"), "lossless", r.get("lossless"))'
done
