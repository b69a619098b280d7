#!/bin/bash
# session 18, call B4 (inline command): the CUDA matmul tests on the final tree (two K groups and pooled counters by default)
export PYTHONPATH=$PWD:/tmp/site; mkdir -p $OUT; timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -k "cuda" --durations=5 > $OUT/pytest-tensor-qmm-cuda.txt 2>&1; echo rc=$?; tail -12 $OUT/pytest-tensor-qmm-cuda.txt
