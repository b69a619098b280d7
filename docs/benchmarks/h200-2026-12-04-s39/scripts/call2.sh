export PYTHONPATH=$PWD:/tmp/site
lscpu | grep "Model name"
timeout 320 python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms auto,0,4 --reps 6 --json $OUT/pacing_4bit_p2.json 2>&1 | grep -v Warning
timeout 230 python3 -m benchmarks.kept_traces --scale full --quant 4bit --context 1024 --tokens 32 --reps 4 --runs 2 --json $OUT/kept_traces_4bit.json 2>&1 | grep -v Warning
