#!/bin/bash
# session 40, call H1: the server's warm-up, measured as its worker runs it. A first process compiles the kernels into mlx's disk cache (discarded), then one process an arm.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 280 python3 .sweep/s40b/first_request.py warm $OUT/H-compile.json 2>&1 | grep -v Warning | tail -2
for arm in cold warm; do
  timeout 150 python3 .sweep/s40b/first_request.py $arm $OUT/H-$arm-1.json 2>&1 | grep -v Warning | tail -2
done
