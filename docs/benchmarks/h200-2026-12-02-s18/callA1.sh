#!/bin/bash
# session 18, call A1: the two-K-group matmul and the SM-load split on the H200 (tests, then device time per projection)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt 2>&1
DFLASH_QMM_TWO_K_GROUPS=1 timeout ${T1:-120} python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -k "cuda" > $OUT/pytest-tensor-qmm-k2.txt 2>&1; echo pytest rc=$?
tail -3 $OUT/pytest-tensor-qmm-k2.txt
timeout ${V1:-230} python3 -m benchmarks.matmul_variants --variants current,waves132,kgroups2,budget70k-waves396 --rows 1,16 --reps 20 --json $OUT/variants-k2.json > $OUT/variants-k2.txt 2>&1; echo variants rc=$?
python3 -c "
import json
rows = json.load(open('$OUT/variants-k2.json'))['rows']
for r in rows: print(r['projection'], r['rows'], r['variant'], r['device_us'], r['kernels_per_call'], r['over_bound'], r['max_abs_diff_vs_mlx'])"
tail -5 $OUT/variants-k2.txt
