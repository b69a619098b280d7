export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader; lscpu | grep "Model name"
timeout 260 python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms 0,4,4t --reps 8 --json $OUT/pacing_4bit_c4.json 2>&1 | grep -v Warning
timeout 60 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_metal_cuda.py -k "scalars or resident" --tb=short -rf 2>&1 | tail -5
timeout 220 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_residual_norm.py tests/test_gated_mlp.py tests/test_traced_layers.py "tests/test_tensor_qmm.py::test_cuda_scaled_form_glimmer_shapes" --tb=short -rf 2>&1 | tail -8
