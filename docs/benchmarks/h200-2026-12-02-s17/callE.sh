#!/bin/bash
# session 17, call E: the folded-offset 4-bit form (tensor_qmm.FOLD_Q4_OFFSET) on the H200: CUDA matmul tests with it on, device time per projection folded vs unfolded, rounds default vs default-folded (4-bit 4k tau 6)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
DFLASH_QMM_FOLDED_OFFSET=1 timeout ${T1:-150} python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -k "cuda" > $OUT/pytest-tensor-qmm-folded.txt 2>&1; echo pytest rc=$?
tail -3 $OUT/pytest-tensor-qmm-folded.txt
timeout ${V1:-150} python3 -m benchmarks.matmul_variants --variants unfolded,folded --rows 1,16 --reps 20 --json $OUT/variants-folded.json > $OUT/variants-folded.txt 2>&1; echo variants rc=$?
python3 -c "
import json
rows = json.load(open('$OUT/variants-folded.json'))['rows']
for r in rows: print(r['projection'], r['rows'], r['variant'], r['device_us'], r['over_bound'], r['max_abs_diff_vs_mlx'])"
timeout ${R1:-260} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 4 --kernels default,default-folded --json $OUT/rp-4bit-4k-folded.json > $OUT/rp-4bit-4k-folded.txt 2>&1; echo rp rc=$?
grep "^{" $OUT/rp-4bit-4k-folded.txt | grep -v '"rounds"' | cut -c1-240
grep '"rounds"' $OUT/rp-4bit-4k-folded.txt | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['kernels'], r['round'], r['verify_graph'], r['verify_launch'], r['draft'], r['draft_launch'], r['wait'], r['lossless'])"
