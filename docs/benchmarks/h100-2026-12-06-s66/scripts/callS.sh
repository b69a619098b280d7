#!/bin/bash
# Session 66 call S: the stacked chunk passes' `cuda` tests (their bits against the
# halves', the traced layers over stacked planes against the eager layers), then a
# round's host split and the verify forward alternated, default against default-wholekv
# (DFLASH_STACKED_KV=1), graphs off. Steps by STEPS (t r v).
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/S
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
ROOT=$PWD
cd .sweep/s66/cur
export PYTHONPATH=$PWD:$PWD/tests:/tmp/site MLX_USE_CUDA_GRAPHS=0
for step in ${STEPS:-t r v}; do
  t0=$(date +%s)
  case $step in
    t) timeout ${TPER:-220} python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_verify_kernels.py tests/test_traced_layers.py tests/test_tensor_attention.py -k "stacked or test_cuda_glimmer_shapes or eager_bits_at_glimmers" > $OUT/S/tests.txt 2>&1
       echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -4 $OUT/S/tests.txt | cut -c1-300 ;;
    r) timeout ${RPER:-200} python3 $ROOT/.sweep/s66/gcwrap.py benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens ${TOK:-96} --runs ${RUNS:-4} --kernels default,default-wholekv --json $OUT/S/rounds.json > $OUT/S/rounds.txt 2>&1
       echo "rounds rc=$? $(( $(date +%s)-t0 ))s"
       grep -v Warning $OUT/S/rounds.txt | python3 -c '
import sys, json
for l in sys.stdin:
    try: r=json.loads(l)
    except Exception: continue
    if isinstance(r, dict) and "verify_graph" in r:
        print("   ", r.get("kernels"), "round", r.get("round"), "vgraph", r.get("verify_graph"), "host", r.get("host_not_waiting"), "lossless", r.get("lossless"))'
       tail -3 $OUT/S/rounds.txt | cut -c1-300 ;;
    v) timeout ${VPER:-150} python3 -m benchmarks.verify_forward --scale full --quant 4bit --context 4096 --kernels default,default-wholekv --reps 5 --warmup 2 --device --device-forwards 6 --json $OUT/S/verify.json > $OUT/S/verify.txt 2>&1
       echo "verify rc=$? $(( $(date +%s)-t0 ))s"; grep -v Warning $OUT/S/verify.txt | tail -6 | cut -c1-300 ;;
  esac
done
