export PYTHONPATH=$PWD:/tmp/site
timeout 190 python3 -m benchmarks.kept_traces --scale full --quant 4bit --context 1024 --tokens 32 --reps 2 --runs 2 --json $OUT/kept_traces_4bit.json 2>&1 | grep -v Warning
