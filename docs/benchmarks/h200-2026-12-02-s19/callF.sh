#!/bin/bash
# session 19, call F: side by side with the public loop, 4-bit 4k, tau 2 and 6, the committed defaults
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/4bit-4k
timeout ${SB:-540} python3 benchmarks/side_by_side.py --out $OUT/4bit-4k --peer-src $PWD/.sweep/peer -- --scale full --quant 4bit --context 4096 --max-tokens 96 --replay-tau 2,6 --passes 1 > $OUT/side-4bit-4k.txt 2>&1; echo sbs rc=$?
tail -5 $OUT/side-4bit-4k.txt | cut -c1-300
cat $OUT/4bit-4k/side-by-side.md 2>/dev/null | head -30
