#!/bin/bash
# session 40, call H2: the warm-up again, arms in the other order.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
for arm in warm cold; do
  timeout 200 python3 .sweep/s40b/first_request.py $arm $OUT/H-$arm-2.json 2>&1 | grep -v Warning | tail -2
done
