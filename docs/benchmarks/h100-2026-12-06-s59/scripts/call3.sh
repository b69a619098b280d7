#!/bin/bash
# Session 59, call 3: the prefetch's cuda tests (bits), then rounds with / without it.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/T $OUT/R
nvidia-smi --query-gpu=name --format=csv,noheader
P="python3 -m pytest -q -p no:cacheprovider -rf"
timeout 150 $P tests/test_prefetch.py tests/test_traced_layers.py -m cuda -k "prefetch or l2 or residual or glimmers_width" > $OUT/T/t1-prefetch.txt 2>&1
echo "== t1"; grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/T/t1-prefetch.txt | tail -6 | cut -c1-300
timeout 200 python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --max-tokens 64 --runs 2 --kernels default,default-unfetched --device-time --json $OUT/R/rounds-4bit.json > $OUT/R/rounds-4bit.txt 2>&1
echo "round_profile rc=$?"
grep -v Warning $OUT/R/rounds-4bit.txt | grep -E "round_median|lossless|error|Error" | cut -c1-250; python3 .sweep/s59/summ.py $OUT/R/rounds-4bit.json
