#!/bin/bash
# session 28, call A: the scaled form's one-lop3 pairs and constant group size against session 26's text (same
# run, 4-bit, 16 and 1 rows); then the cuda tests of the new text in four parallel processes: the matmul, the
# gated MLP + traced layers (the geometry-key fix), the layer stack + metal, and the kernel patch's bitwise agreement.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
TORCHPY=/opt/torch/.venv/bin/python3
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-A.txt 2>&1
S4="mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj"
show() { grep "^{" $1 | python3 -c "import sys,json; [print(r['projection'][:14], r['rows'], r['variant'], r['device_us'], r['over_bound'], r['max_abs_diff_vs_mlx']) for r in map(json.loads, sys.stdin)]"; }
timeout 170 $TORCHPY -m benchmarks.matmul_variants --rows 16,1 --variants current,scaled-s26,twolop,groupparam --shapes "$S4" --json $OUT/A-4bit.json > $OUT/A-4bit.txt 2>&1; echo 4bit rc=$?
show $OUT/A-4bit.txt
timeout 60 $TORCHPY -m benchmarks.matmul_variants --bits 8 --rows 16 --variants current,scaled-s26 --shapes "$S4" --json $OUT/A-8bit.json > $OUT/A-8bit.txt 2>&1; echo 8bit rc=$?
show $OUT/A-8bit.txt
P="python3 -m pytest -q -p no:cacheprovider"
timeout 340 $P tests/test_tensor_qmm.py tests/test_verify_kernels.py -m cuda > $OUT/A-pytest-matmul-cuda.txt 2>&1 &
timeout 340 $P tests/test_gated_mlp.py tests/test_traced_layers.py -m cuda > $OUT/A-pytest-gated-traced.txt 2>&1 &
timeout 340 $P tests/test_layer_stack.py tests/test_metal_cuda.py -m cuda > $OUT/A-pytest-stack-metal.txt 2>&1 &
timeout 340 $P tests/test_kernel_patch.py -k "agree_bitwise or generators_install or near_ties or default_on_only or with_or_without" > $OUT/A-pytest-kernel-patch.txt 2>&1 &
wait
for f in $OUT/A-pytest-*.txt; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" $f | tail -4 | cut -c1-300; done
