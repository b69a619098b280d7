#!/bin/bash
# session 22, call C2: side by side with the public loop (4-bit 4k tau 6), the stacked block and lean fetch in
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${SB:-400} python3 -m benchmarks.side_by_side --out $OUT/sbs --peer-src $PWD/.sweep/peer -- --scale full --quant 4bit --context 4096 --max-tokens 96 --replay-tau 6 --passes 2 > $OUT/sbs.txt 2>&1; echo sbs rc=$?; tail -12 $OUT/sbs.txt | cut -c1-250
