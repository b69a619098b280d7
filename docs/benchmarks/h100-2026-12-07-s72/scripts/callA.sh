#!/bin/bash
# Session 72: our plain 8-bit decoding with the verify kernels (today's default) against
# kernels off and mlx-lm's own, per token in the real loop (plain_phases: mlx-lm, default,
# off each pass), with mlx's CUDA graphs on (the 8-bit default), then off.
# Usage, from the repository root with the tree in .sweep/s66/cur: bash callA.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/P
nvidia-smi --query-gpu=name --format=csv,noheader
for g in 1 0; do
  t0=$(date +%s)
  (cd .sweep/s66/cur && PYTHONPATH=$PWD:/tmp/site MLX_USE_CUDA_GRAPHS=$g timeout ${PER:-200} python3 -m benchmarks.plain_phases --scale full --quant 8bit --context 4096 --tokens 40 --passes ${PASSES:-3} --kernels default,off --json $OUT/P/plain-8bit-g$g.json > $OUT/P/plain-8bit-g$g.txt 2>&1)
  echo "graphs=$g rc=$? $(( $(date +%s)-t0 ))s"; grep '"arm"' $OUT/P/plain-8bit-g$g.txt | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['pass'], r['arm'], {k:v for k,v in r.items() if k.endswith('_ms') or k=='launches'})" | cut -c1-250
done
