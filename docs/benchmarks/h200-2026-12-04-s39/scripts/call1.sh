export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader; nproc; lscpu | grep "Model name"
timeout 500 python3 -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 --tokens 96 --arms 0,4,auto --reps 8 --json $OUT/pacing_4bit_p1.json 2>&1 | grep -v Warning
