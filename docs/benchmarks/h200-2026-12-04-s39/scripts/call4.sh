export PYTHONPATH=$PWD:/tmp/site
timeout 450 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_traced_layers.py "tests/test_tensor_qmm.py::test_cuda_scaled_form_glimmer_shapes" --tb=short -rf --durations=5 2>&1 | tail -15
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_pacing.py tests/test_taps.py --tb=short -rf 2>&1 | tail -5
