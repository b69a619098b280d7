#!/bin/bash
# session 14, call F: attention calls (CUPTI device time and wall), the fold as its own launch (0) and merged into the chunk pass (1)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TORCHPY=/opt/torch/.venv/bin/python3
for v in 0 1; do
  DFLASH_MERGED_FOLD=$v timeout ${EACH:-250} $TORCHPY -m benchmarks.verify_kernels --only attention --skip-scalar --device-time --json $OUT/attention-fold-$v.json > $OUT/attention-fold-$v.txt 2>&1; echo fold=$v rc=$?
  grep "^{" $OUT/attention-fold-$v.txt | cut -c1-260 | tail -8
done
