export PYTHONPATH=$PWD:/tmp/site
timeout 300 python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms auto,0,4 --reps 8 --json $OUT/pacing_4bit_p5.json 2>&1 | grep -v Warning
