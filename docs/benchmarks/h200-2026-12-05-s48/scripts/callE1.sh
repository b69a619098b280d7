#!/bin/bash
# session 48, call E1: per call, the vector merge (vecmerge) and the denormal 4-bit decode (denorm4) against the
# shipped forms; then the cuda tests with DFLASH_QMM_VECTOR_MERGE=1 (every matmul form carries the vector merge):
# the matmul's tests that take a K split or every form, SwiGLU's, the bitwise patch / traced-layer tests.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/E1
timeout 130 python3 -m benchmarks.matmul_variants --variants current,vecmerge,denorm4 --rows 1,16 --shapes "mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused;lm_head" --json $OUT/E1/merge-denorm.json > $OUT/E1/merge-denorm.txt 2>&1; echo variants rc=$?
python3 - $OUT/E1/merge-denorm.json <<'PY2'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f'{r["projection"][:22]:22} {r["rows"]:>2} {r["variant"]:10} {r["device_us"]:7.1f} us {r["over_bound"]:5.2f}x same {r.get("same_bits_as_current")}')
PY2
export DFLASH_QMM_VECTOR_MERGE=1
timeout 220 python3 -m pytest -q -p no:cacheprovider -x -m cuda tests/test_tensor_qmm.py -k "merged_split_sum or glimmer_shapes or member_major or every_scaled_kernel or leading_shape or unaligned or batch_invariant" > $OUT/E1/tests-qmm.txt 2>&1; echo qmm rc=$?; tail -2 $OUT/E1/tests-qmm.txt
timeout 80 python3 -m pytest -q -p no:cacheprovider -x -m cuda tests/test_gated_mlp.py > $OUT/E1/tests-swiglu.txt 2>&1; echo swiglu rc=$?; tail -2 $OUT/E1/tests-swiglu.txt
timeout 100 python3 -m pytest -q -p no:cacheprovider -x -m cuda tests/test_verify_kernels.py tests/test_traced_layers.py > $OUT/E1/tests-bitwise.txt 2>&1; echo bitwise rc=$?; tail -2 $OUT/E1/tests-bitwise.txt
cd $OUT && tar czf E1.tgz E1 && rm -rf E1
