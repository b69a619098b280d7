export PYTHONPATH=$PWD:/tmp/site
timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_metal_cuda.py -k "scalars or resident" --tb=long -rf 2>&1 | tail -60
export DFLASH_VERIFY_KERNELS=1
timeout 400 python3 -m benchmarks.pacing_ab --scale full --quant bf16 --context 4096 --tokens 96 --arms 0,4,4t --reps 6 --json $OUT/pacing_bf16_c3.json 2>&1 | grep -v Warning
