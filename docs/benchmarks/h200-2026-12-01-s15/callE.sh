#!/bin/bash
# session 15, call E: the committed default (compile on by default on CUDA, no switch set): the kernel-patch tests that touch compile, binding and bitwise agreement, on the GPU
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -c "from dflash.metal import backend; print('compile_wanted', backend.compile_wanted(), backend.BACKEND)"
timeout ${PT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "compile or bitwise or bound_again or small_row_route or frees" > $OUT/pytest-patch-default.txt 2>&1; echo pytest rc=$?
tail -4 $OUT/pytest-patch-default.txt | cut -c1-300
