#!/bin/bash
# session 24, call E: the default now installs the kernels in plain (and classic) decoding of 4-bit Glimmer on CUDA: bitwise tests on the GPU; rounds with the default (lossless against our plain, our plain against mlx-lm's); plain decoding at 32k with the kernels vs off
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
cp .sweep/s24/callE.sh $OUT/
timeout ${T1:-150} python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "agree_bitwise or generators_install or near_ties or default_on_only or with_or_without" > $OUT/E-pytest-kernel-patch.txt 2>&1; echo kp rc=$?; tail -3 $OUT/E-pytest-kernel-patch.txt
timeout ${T2:-200} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 2 --kernels default,off --json $OUT/E-rp-4k.json > $OUT/E-rp-4k.txt 2>&1; echo rp rc=$?; grep "^{" $OUT/E-rp-4k.txt | cut -c1-200 | tail -3; python3 -c "
import json; d=json.load(open('$OUT/E-rp-4k.json')); print('plain==mlx-lm', d['plain_equals_mlx_lm'], 'divergences', d['plain_divergences']); print('lossless', [(r['kernels'], r['lossless']) for r in d['runs']])"
timeout ${T3:-200} python3 -m benchmarks.plain_phases --scale full --quant 4bit --context 32768 --tokens 40 --passes 2 --kernels off,all --json $OUT/E-plain-32k.json > $OUT/E-plain-32k.txt 2>&1; echo pp rc=$?; grep "^{" $OUT/E-plain-32k.txt | cut -c1-200
