#!/bin/bash
# session 18, call B3 (inline command): the 4k verify layer stack, ours, before (.sweep/old = 0ceb6e7) and after, alternating processes, 3 reps each
export PYTHONUNBUFFERED=1; mkdir -p $OUT; NEW=$PWD; OLD=$PWD/.sweep/old; for i in 1 2 3; do for t in old new; do d=$OLD; [ $t = new ] && d=$NEW; (cd $d && PYTHONPATH=$d:/tmp/site timeout 60 python3 -m benchmarks.layer_stack --quant 4bit --layers 8 --context 4096 --arms ours --reps 3 --json $OUT/ab-$t-$i.json > /tmp/ab-$t-$i.txt 2>&1); echo "$t $i rc=$?"; grep '"rep"' /tmp/ab-$t-$i.txt | cut -c1-160; done; done
