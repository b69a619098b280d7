export PYTHONPATH=$PWD:/tmp/site
lscpu | grep "Model name"
timeout 290 python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms 0,4,auto --reps 6 --json $OUT/pacing_4bit_p6.json 2>&1 | grep -v Warning
