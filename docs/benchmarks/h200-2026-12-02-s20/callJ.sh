#!/bin/bash
# session 20, call J: head prep (q/k norms + scale + RoPE in one launch): tests on the GPU, bits against mlx, the layer's kernels on/off
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${T1:-150} python3 -m pytest -q -p no:cacheprovider tests/test_head_prep.py tests/test_prepared_heads.py > $OUT/pytest-head-prep.txt 2>&1; echo hp rc=$?; tail -3 $OUT/pytest-head-prep.txt; grep -E "^(FAILED|E  )" $OUT/pytest-head-prep.txt | head -8 | cut -c1-300
timeout 60 python3 .sweep/s20/diag_head_prep.py $OUT/head-prep-bits.json > /dev/null 2>&1; echo diag rc=$?; python3 -c "
import json; [print(r) for r in json.load(open('$OUT/head-prep-bits.json'))]" | cut -c1-200
stack() { DFLASH_HEAD_PREP=$2 timeout 90 python3 -m benchmarks.layer_stack --quant 4bit --layers 4 --context 4096 --arms ours --forwards 10 --passes 2 --trace --json $OUT/stack-$1.json > $OUT/stack-$1.txt 2>&1; echo stack $1 rc=$?; python3 -c "
import json; d=json.load(open('$OUT/stack-$1.json'))
for a,t in d['traces'].items(): print(a, t['kernels_per_layer'], t['busy_us_per_layer'], t['span_us_per_layer']); print(t['sequence'][:26])
for r in d['runs']: print(r)" 2>&1 | cut -c1-1200; }
stack prep 1; stack unprep 0
timeout ${T4:-120} python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "agree_bitwise or near_ties or matches_mlx" > $OUT/pytest-kp-bitwise.txt 2>&1; echo kpb rc=$?; tail -2 $OUT/pytest-kp-bitwise.txt
