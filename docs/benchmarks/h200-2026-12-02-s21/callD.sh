#!/bin/bash
# session 21, call D: side by side with the public DFlash MLX loop (4-bit, 4k, tau 2 and 6)
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout ${SB:-560} python3 -m benchmarks.side_by_side --out $OUT/sbs --peer-src $PWD/.sweep/peer -- --scale full --quant 4bit --context 4096 --max-tokens 96 --replay-tau ${TAUS:-2,6} --passes ${PASSES:-2} > $OUT/sbs.txt 2>&1; echo sbs rc=$?; tail -30 $OUT/sbs.txt | cut -c1-250; ls $OUT/sbs
