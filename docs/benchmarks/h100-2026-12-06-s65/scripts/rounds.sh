#!/bin/bash
# Session 63: round_profile processes by arm. An arm is ENV[:TREE] with ENV one of
# G graphs off, D graphs on (mlx's default), S G + DFLASH_SWIGLU=1, P G + DFLASH_EVAL_EVERY=4,
# R G + the drafter's three opt-in parts,
# and TREE cur (HEAD 9d92d98, 18.25 graph nodes a verify layer) or old (12d5785, 23.75).
# Usage: rounds.sh "G:cur G:old ..."
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/R
ROOT=$PWD
i=0
for spec in $1; do
  i=$((i+1))
  arm=${spec%%:*}; tree=cur; [[ $spec == *:* ]] && tree=${spec#*:}
  dir=$ROOT/.sweep/s63/$tree
  case $arm in
    G) envs="MLX_USE_CUDA_GRAPHS=0" ;;
    D) envs="MLX_USE_CUDA_GRAPHS=1" ;;
    S) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_SWIGLU=1" ;;
    P) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_EVAL_EVERY=4" ;;
    C) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_QMM_CLUSTER_SUM=1" ;;
    U) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_QMM_CLUSTER_SUM=0" ;;
    R) envs="MLX_USE_CUDA_GRAPHS=0 DFLASH_DRAFTER_FUSED_QKV=1 DFLASH_DRAFTER_HEAD_PREP=1 DFLASH_DRAFTER_TRACED=1" ;;
  esac
  f=$OUT/R/${TAG:-r}$i-$arm-$tree.txt
  t0=$(date +%s)
  (cd $dir && env PYTHONPATH=$dir:/tmp/site $envs timeout ${PER:-170} python3 $ROOT/.sweep/s63/gcwrap.py benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens ${TOK:-96} --runs ${RUNS:-3} --kernels default ${EXTRA:-} > $f 2>&1)
  rc=$?
  echo "$i $arm $tree rc=$rc $(( $(date +%s)-t0 ))s"
  grep -v Warning $f | python3 -c '
import sys, json
for l in sys.stdin:
    try: r=json.loads(l)
    except Exception: continue
    if "verify_graph" in r:
        print("   round", r.get("round"), "vgraph", r.get("verify_graph"), "host", r.get("host_not_waiting"), "wait", r.get("wait"), "n", r.get("rounds"), "lossless", r.get("lossless"))'
  [ $rc -ne 0 ] && tail -5 $f | cut -c1-300
done
