export PYTHONPATH=$PWD:/tmp/site
timeout 540 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_residual_norm.py tests/test_gated_mlp.py --tb=short -rf --durations=5 2>&1 | tail -15
