#!/bin/bash
# session 14, call G: main with the kernel-text cleanup (merged fold not taken): the shipped names, the fused-projection tests, every kernel-patch test (default switches)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 - > $OUT/shipped-names-main.txt 2>&1 <<'PY'
from dflash.metal import attention, tensor_attention, tensor_qmm
names = {tensor_attention.attend_spec(128, layout).name("cuda") for layout in tensor_attention.LAYOUTS.values()}
names.add(attention.FOLD_CHUNKS.name("cuda"))
names.update(spec.name("cuda") for spec in tensor_qmm.SPECS)
print("\n".join(sorted(names)))
PY
cat $OUT/shipped-names-main.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py > $OUT/pytest-patch-main.txt 2>&1; echo pytest-patch rc=$?
tail -3 $OUT/pytest-patch-main.txt | cut -c1-300
timeout 380 python3 -m pytest -q -p no:cacheprovider tests/test_fused_projections.py --durations=3 > $OUT/pytest-fused-main.txt 2>&1; echo pytest-fused rc=$?
tail -8 $OUT/pytest-fused-main.txt | cut -c1-300
