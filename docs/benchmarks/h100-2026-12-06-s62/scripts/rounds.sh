#!/bin/bash
# Session 62: the round's host split (round_profile, no CUPTI) by mlx encoder setting.
# D default; G MLX_USE_CUDA_GRAPHS=0; C G + DFLASH_QMM_CLUSTER_SUM=1;
# B MLX_MAX_MB_PER_BUFFER=100000 (commit by op count only); K MLX_CUDA_GRAPH_CACHE_SIZE=4000
# Usage: rounds.sh "D G C B" [extra round_profile args]
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/R
ROOT=$PWD
dir=$PWD/.sweep/s62/${TREE:-cur}
[ "${TREE:-cur}" = root ] && dir=$PWD
i=0
for arm in $1; do
  i=$((i+1))
  envs="DFLASH_S62=1"
  case $arm in
    G) envs="MLX_USE_CUDA_GRAPHS=0" ;;
    C) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_QMM_CLUSTER_SUM=1" ;;
    B) envs="MLX_MAX_MB_PER_BUFFER=100000" ;;
    K) envs="MLX_CUDA_GRAPH_CACHE_SIZE=4000" ;;
    O) envs="MLX_MAX_OPS_PER_BUFFER=400 MLX_MAX_MB_PER_BUFFER=100000" ;;
    N) envs="S62_GC=off" ;;
  esac
  f=$OUT/R/${TAG:-r}$i-$arm.txt
  t0=$(date +%s)
  (cd $dir && env PYTHONPATH=$dir:/tmp/site $envs timeout ${PER:-170} python3 $ROOT/.sweep/s62/gcwrap.py benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens ${TOK:-96} --runs ${RUNS:-3} --kernels default ${2:-} > $f 2>&1)
  rc=$?
  echo "$i $arm rc=$rc $(( $(date +%s)-t0 ))s"
  grep -v Warning $f | python3 -c '
import sys, json
for l in sys.stdin:
    try: r=json.loads(l)
    except Exception: continue
    if "verify_graph" in r:
        print("   round", r.get("round"), "vgraph", r.get("verify_graph"), "host", r.get("host_not_waiting"), "wait", r.get("wait"), "dlaunch", r.get("draft_launch"), "n", r.get("rounds"), "lossless", r.get("lossless"))
    elif "round_median" in r or "plain" in str(r)[:200]:
        print("  ", json.dumps(r)[:300])'
  grep "^GC" $f; [ $rc -ne 0 ] && tail -5 $f | cut -c1-300
done
