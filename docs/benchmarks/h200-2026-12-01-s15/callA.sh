#!/bin/bash
# session 15, call A: bound matmuls replayed by mx.compile (DFLASH_COMPILE=1): kernel-patch tests under it (cuda), then rounds and plain tokens at 4-bit 4k, arms off / all / all-compiled
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
DFLASH_COMPILE=1 timeout ${PT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "not small_row_route" > $OUT/pytest-patch-compiled.txt 2>&1; echo pytest-patch rc=$?
tail -3 $OUT/pytest-patch-compiled.txt | cut -c1-300
timeout ${RP:-300} python3 -m benchmarks.round_profile --scale full --quant 4bit --context 4096 --tau 6 --max-tokens 64 --runs 3 --plain-time --kernels off,all,all-compiled --json $OUT/rp-4bit-4k-compiled.json > $OUT/rp-4bit-4k-compiled.txt 2>&1; echo rp rc=$?
grep "^{" $OUT/rp-4bit-4k-compiled.txt | grep -v '"rounds"' | cut -c1-300
