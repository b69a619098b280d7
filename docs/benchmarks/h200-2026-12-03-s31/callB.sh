#!/bin/bash
# session 31, call B: chunk-pass variants in one process a case (Nsight Compute), and the shipped pass by SASS line.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT /tmp/B
V=.sweep/s31/attn_variants2.py
M="--metrics gpc__cycles_elapsed.max,sm__cycles_active.avg,smsp__inst_executed.sum,launch__grid_size,launch__block_size,launch__registers_per_thread"
run() {  # tag, extra ncu flags, variant args
  tag=$1; shift; flags=$1; shift
  timeout ${T:-100} ncu $M $flags --kernel-name regex:"attend_chunks|fold" --launch-count 200 -f -o /tmp/B/$tag python3 $V "$@" > /tmp/B/$tag.log 2>&1
  echo "== $tag rc=$? ($*) $flags"; grep -E "^variant|Error|error" /tmp/B/$tag.log | cut -c1-200
  ncu -i /tmp/B/$tag.ncu-rep --page raw --csv 2>/dev/null | python3 .sweep/s31/ncu_table.py
}
{
T=140 run g16 "" 4096 growing 16 base,wide2,nostores,nocombine,stream
timeout 110 ncu --section SourceCounters --section WarpStateStats --kernel-name regex:"attend_chunks" --launch-skip 1 --launch-count 1 -f -o /tmp/B/src python3 $V 4096 growing 16 base > /tmp/B/src.log 2>&1; echo src rc=$?
ncu -i /tmp/B/src.ncu-rep --page source --csv --print-source sass > /tmp/B/src-sass.csv 2>&1; echo csv rc=$?
gzip -c /tmp/B/src-sass.csv > $OUT/B-src-sass.csv.gz
ncu -i /tmp/B/src.ncu-rep --page details > $OUT/B-src-details.txt 2>&1
run g1 "" 4096 growing 1 base,wide2,nostores,nocombine
T=80 run r16 "" 4096 ring 16 base,wide2
T=80 run g16nc "--cache-control none" 4096 growing 16 base,wide2
} 2>&1 | tee $OUT/B-summary.txt
ls -la $OUT
