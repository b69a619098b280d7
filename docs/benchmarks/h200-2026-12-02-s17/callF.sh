#!/bin/bash
# session 17, call F: the wave-aware K split (tensor_qmm.WAVE_SPLIT) on the H200: CUDA matmul tests with it on, device time per projection target vs waves, rounds default vs default-waves (4-bit 4k tau 6)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${V1:-120} python3 -m benchmarks.matmul_variants --variants target,waves --rows 1,16 --reps 20 --json $OUT/variants-waves.json > $OUT/variants-waves.txt 2>&1; echo variants rc=$?
python3 -c "
import json
rows = json.load(open('$OUT/variants-waves.json'))['rows']
for r in rows: print(r['projection'], r['rows'], r['variant'], r['device_us'], r['kernels_per_call'], r['over_bound'], r['max_abs_diff_vs_mlx'])"
DFLASH_QMM_WAVE_SPLIT=1 timeout ${T1:-110} python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -k "cuda" > $OUT/pytest-tensor-qmm-waves.txt 2>&1; echo pytest rc=$?
tail -3 $OUT/pytest-tensor-qmm-waves.txt
timeout ${R1:-230} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 3 --kernels default,default-waves --json $OUT/rp-4bit-4k-waves.json > $OUT/rp-4bit-4k-waves.txt 2>&1; echo rp rc=$?
grep "^{" $OUT/rp-4bit-4k-waves.txt | grep -v '"rounds"' | cut -c1-240
grep '"rounds"' $OUT/rp-4bit-4k-waves.txt | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['kernels'], r['round'], r['verify_graph'], r['verify_launch'], r['draft'], r['draft_launch'], r['wait'], r['lossless'])"
