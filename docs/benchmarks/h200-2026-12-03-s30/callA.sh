#!/bin/bash
# session 30, call A: the pair layout and the row fold on the H200 (their `cuda` tests, four processes at once),
# then the attention calls timed.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-A.txt 2>&1
P="python3 -m pytest -q -p no:cacheprovider tests/test_tensor_attention.py -m cuda"
timeout 240 $P -k matches_oracle_and_reference > $OUT/A-pytest-oracle.txt 2>&1 &
timeout 240 $P -k batch_invariant > $OUT/A-pytest-invariant.txt 2>&1 &
timeout 240 $P -k seam > $OUT/A-pytest-seam.txt 2>&1 &
timeout 240 $P -k "not matches_oracle_and_reference and not batch_invariant and not seam" > $OUT/A-pytest-rest.txt 2>&1 &
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_verify_kernels.py -m cuda -k gate > $OUT/A-pytest-gated.txt 2>&1 &
wait
for f in $OUT/A-pytest-*.txt; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $f | tail -4 | cut -c1-300; done
timeout 150 python3 .sweep/s30/attn_probe.py $OUT/A-attn.json > $OUT/A-attn.txt 2>&1; echo probe rc=$?
grep -v "^{" $OUT/A-attn.txt | cut -c1-500 | tail -12
