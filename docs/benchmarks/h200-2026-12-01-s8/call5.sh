#!/bin/bash
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 45 ncu --kernel-name regex:attend_chunks_stream --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats python3 .sweep/ncu_probe.py stream > $OUT/ncu-stream.txt 2>&1; grep -iE "error|duration|Achieved Occupancy|Stall|Theoretical Occupancy|Registers|Memory Throughput|Compute \(SM\)" $OUT/ncu-stream.txt | head -20
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/test_verify_kernels.py -m cuda 2>&1 | tail -5 > $OUT/tests-cuda.txt; tail -2 $OUT/tests-cuda.txt
timeout 110 python3 -m benchmarks.round_profile --scale full --quant bf16 --context 4096 --tau 6 --max-tokens 96 --runs 3 --kernels off,attention --json $OUT/rp-bf16-4k.json 2>&1 | grep "^{" | cut -c1-330
timeout 100 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 96 --runs 1 --kernels off,attention --json $OUT/rp-4bit-4k.json 2>&1 | grep "^{" | cut -c1-330
