export PYTHONPATH=$PWD:/tmp/site
timeout 560 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_head_prep.py tests/test_wired_cache.py tests/test_metal_cuda.py tests/test_tensor_attention.py tests/test_verify_kernels.py tests/test_tensor_qmm.py tests/test_residual_norm.py tests/test_gated_mlp.py tests/test_traced_layers.py 2>&1 | tail -15
