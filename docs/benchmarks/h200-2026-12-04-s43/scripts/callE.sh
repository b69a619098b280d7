#!/bin/bash
# session 43, call E: kernel texts handed to mlx as #include lines (metal/kernel_files.py, on by default) -- the `cuda`
# tests of every kernel family in parallel processes (all writing their texts to the default ~/.cache/dflash/cuda-texts
# at once), then what the directory holds.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
rm -rf ~/.cache/dflash/cuda-texts
P="python3 -m pytest -q -p no:cacheprovider"
timeout 500 $P tests/test_tensor_qmm.py -m cuda -k "not every_scaled" > $OUT/E1-qmm.txt 2>&1 &
timeout 500 $P tests/test_tensor_qmm.py -m cuda -k every_scaled > $OUT/E2-qmm-every-scaled.txt 2>&1 &
timeout 500 $P tests/test_tensor_attention.py tests/test_verify_kernels.py -m cuda > $OUT/E3-attention-verify.txt 2>&1 &
timeout 500 $P tests/test_head_prep.py tests/test_residual_norm.py tests/test_launch_scalars.py -m cuda > $OUT/E4-heads-norms-scalars.txt 2>&1 &
timeout 500 $P tests/test_gated_mlp.py tests/test_traced_layers.py -m cuda > $OUT/E5-gated-traced.txt 2>&1 &
timeout 500 $P tests/test_kernel_patch.py -k "agree_bitwise or generators_install or near_ties or default_on_only or with_or_without" > $OUT/E6-kernel-patch.txt 2>&1 &
timeout 500 $P tests/test_layer_stack.py tests/test_metal_cuda.py -m cuda > $OUT/E7-stack-metal.txt 2>&1 &
timeout 500 $P tests/test_kernel_files.py > $OUT/E8-kernel-files.txt 2>&1 &
wait
for f in $OUT/E*.txt; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" $f | tail -4 | cut -c1-300; done
echo "texts written: $(ls ~/.cache/dflash/cuda-texts | wc -l) files, $(du -sh ~/.cache/dflash/cuda-texts | cut -f1); temporaries left: $(ls ~/.cache/dflash/cuda-texts | grep -c tmp)"
ls ~/.cache/dflash/cuda-texts | head -5
