#!/bin/bash
# session 13, call A: branch merged-split-sum: the CUDA matmul tests, current vs merged device time, the fused-test probe
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TORCHPY=/opt/torch/.venv/bin/python3
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -m cuda > $OUT/pytest-cuda-qmm-merged.txt 2>&1; echo pytest rc=$?
tail -4 $OUT/pytest-cuda-qmm-merged.txt
timeout 200 $TORCHPY -m benchmarks.matmul_variants --variants current,merged --json $OUT/variants-merged.json 2>&1 | cut -c1-220 | tail -30
timeout 100 python3 .sweep/s13/fused_probe2.py mixed 300 > $OUT/fused-probe2.txt 2>&1; echo probe rc=$?
cut -c1-400 $OUT/fused-probe2.txt | tail -12
