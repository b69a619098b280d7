#!/bin/bash
# session 23, call E: traced layers (two compiled replays a served layer call): cuda tests, layer stack A/B with and without SwiGLU; SwiGLU's one-K-group forms
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${T1:-170} python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_traced_layers.py --durations=4 > $OUT/E-pytest-traced-cuda.txt 2>&1; echo traced rc=$?; tail -3 $OUT/E-pytest-traced-cuda.txt; grep -E "^(FAILED|E  )" $OUT/E-pytest-traced-cuda.txt | head -8 | cut -c1-300
timeout ${T2:-150} python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms ours,ours-traced --forwards 16 --passes 2 --reps 4 --trace --json $OUT/E-stack-traced.json > $OUT/E-stack-traced.txt 2>&1; echo stack rc=$?; grep '^{' $OUT/E-stack-traced.txt | grep -v sequence | cut -c1-220
DFLASH_SWIGLU=1 timeout ${T3:-120} python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms ours,ours-traced --forwards 16 --passes 2 --reps 3 --trace --json $OUT/E-stack-traced-swiglu.json > $OUT/E-stack-traced-swiglu.txt 2>&1; echo stack-swiglu rc=$?; grep '^{' $OUT/E-stack-traced-swiglu.txt | grep -v sequence | cut -c1-220
python3 -c "
import json
for f in ('E-stack-traced', 'E-stack-traced-swiglu'):
    d=json.load(open('$OUT/'+f+'.json'))
    for a,t in d['traces'].items(): print(f, a, t['kernels_per_layer'], t['busy_us_per_layer'], t['span_us_per_layer'])" 2>&1 | cut -c1-600
DFLASH_QMM_TWO_K_GROUPS=0 timeout ${T4:-90} python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_gated_mlp.py -k "not install_probe" > $OUT/E-pytest-swiglu-k1-cuda.txt 2>&1; echo swiglu-k1 rc=$?; tail -2 $OUT/E-pytest-swiglu-k1-cuda.txt
