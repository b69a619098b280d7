#!/bin/bash
# session 16, call G: whole MLP blocks through mx.compile (KernelPatch compile_blocks) on the H200: GPU tests, then rounds at tau 6, default-unblocked vs default, 4-bit 4k
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${T1:-130} python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "compiled_forwards or mlp_block or compiled_blocks or agree_bitwise" > $OUT/pytest-blocks.txt 2>&1; echo pytest rc=$?
tail -3 $OUT/pytest-blocks.txt
timeout ${R1:-200} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 3 --kernels default-unblocked,default --json $OUT/rp-4bit-4k-blocks.json > $OUT/rp-4bit-4k-blocks.txt 2>&1; echo rp rc=$?
grep "^{" $OUT/rp-4bit-4k-blocks.txt | grep -v '"rounds"' | cut -c1-240
grep '"rounds"' $OUT/rp-4bit-4k-blocks.txt | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['kernels'], r['round'], r['verify_graph'], r['verify_launch'], r['draft'], r['draft_launch'], r['wait'], r['lossless'])"
