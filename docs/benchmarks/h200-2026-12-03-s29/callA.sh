#!/bin/bash
# session 29, call A: the group-128 SwiGLU scaled kernels (their fixed test), then the side by side with full
# blocks to the end (4-bit, 4k, tau 6, 96 tokens), as session 28 could not run them.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
P="python3 -m pytest -q -p no:cacheprovider"
timeout 150 $P tests/test_gated_mlp.py -m cuda -k every_group_size > $OUT/A-pytest-every-swiglu.txt 2>&1; echo swiglu rc=$?
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/A-pytest-every-swiglu.txt | tail -4 | cut -c1-300
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-A.txt 2>&1
timeout 330 python3 -m benchmarks.side_by_side --out $OUT/A-sbs --peer-src $PWD/.sweep/peer -- --scale full --quant 4bit --context 4096 --max-tokens 96 --replay-tau 6 --passes 3 > $OUT/A-sbs.txt 2>&1; echo sbs rc=$?; tail -12 $OUT/A-sbs.txt | cut -c1-300
