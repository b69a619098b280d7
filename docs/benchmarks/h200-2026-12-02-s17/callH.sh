#!/bin/bash
# session 17, call H (run as an inline command): the 16-row layer stack (4-bit, our kernels) with the K split rule of before (0) and the wave-aware one (1), alternating processes
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1; mkdir -p $OUT; for w in 0 1 0 1; do DFLASH_QMM_WAVE_SPLIT=$w timeout 70 python3 .sweep/s17/layer_compile.py --geometry full --quant 4bit --layers 8 --forwards 30 --passes 3 --reps 1 --arms ours > $OUT/layer-waves$w-$RANDOM.txt 2>&1; echo waves=$w; done
