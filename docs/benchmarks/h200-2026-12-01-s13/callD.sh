#!/bin/bash
# session 13, call D: mlx's quantized_matmul at the fused test's geometries (and K 512) against dequantize + matmul
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 150 python3 .sweep/s13/qmm_probe.py ${1:-a} > $OUT/qmm-probe-${1:-a}.txt 2>&1; echo probe rc=$?
grep -c '"ok": true' $OUT/qmm-probe-${1:-a}.txt; grep -v '"ok": true' $OUT/qmm-probe-${1:-a}.txt | cut -c1-300
