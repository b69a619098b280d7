#!/bin/bash
# session 14, call A: branch merged-fold (+ kernel-text cleanup): the shipped names, the CUDA attention tests (merged fold included), the CUDA matmul tests
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 - > $OUT/shipped-names.txt 2>&1 <<'PY'
from dflash.metal import attention, tensor_attention, tensor_qmm
names = {tensor_attention.attend_spec(128, layout).name("cuda") for layout in tensor_attention.LAYOUTS.values()}
names.add(attention.FOLD_CHUNKS.name("cuda"))
names.update(spec.name("cuda") for spec in tensor_qmm.SPECS)
print("\n".join(sorted(names)))
PY
cat $OUT/shipped-names.txt
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_attention.py -m cuda -rs --durations=5 > $OUT/pytest-cuda-attention-fold.txt 2>&1; echo pytest-att rc=$?
tail -12 $OUT/pytest-cuda-attention-fold.txt | cut -c1-300
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -m cuda > $OUT/pytest-cuda-qmm.txt 2>&1; echo pytest-qmm rc=$?
tail -3 $OUT/pytest-cuda-qmm.txt | cut -c1-300
