#!/bin/bash
# session 27, call G: the fused-MLP and traced-layer cuda tests in one process (as call D2 ran them), with the
# scaled-weight form on and off: does the traced-layer failure follow the gated-MLP tests or the form?
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
for s in 1 0; do DFLASH_QMM_SCALED_B=$s timeout 165 python3 -m pytest -q -p no:cacheprovider -x tests/test_gated_mlp.py tests/test_traced_layers.py -m cuda > $OUT/G-pytest-scaled$s.txt 2>&1; echo scaled=$s rc=$?; grep -E "^E |differs|passed|failed|^tests.*(::| )" $OUT/G-pytest-scaled$s.txt | cut -c1-300 | head -30; done
