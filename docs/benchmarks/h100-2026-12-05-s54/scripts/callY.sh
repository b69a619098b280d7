#!/bin/bash
# session 54, call Y: unit scales' denormal tests again (the name check fixed), then per call (cold) the
# scale copies as they are, skipped, as a chunk-major repack would lie, and as units; then ncu of gate+up 16 rows.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/Y
P="python3 -m pytest -q -p no:cacheprovider -rf"
env DFLASH_QMM_UNIT_SCALES=1 timeout 200 $P tests/test_tensor_qmm.py -m cuda -k "denormal" > $OUT/Y/y1-denormal-unit.txt 2>&1; echo "tests rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/Y/y1-denormal-unit.txt | tail -4 | cut -c1-300
S="mlp gate+up fused;mlp down;o_proj;attn q/k/v/gate fused"
timeout 150 python3 -m benchmarks.matmul_variants --variants current,shifted,noscales,contigscales,unit --rows 1,16 --shapes "$S" --cold-bytes 268435456 --json $OUT/Y/scales-cold.json > $OUT/Y/scales-cold.txt 2>&1; echo q4 rc=$?
python3 - $OUT/Y/scales-cold.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(r["projection"], r["rows"], r["variant"], r["device_us"], r["over_bound"], r.get("same_bits_as_current"))
PY
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section SourceCounters --section InstructionStats --section Occupancy"
for v in shifted noscales contigscales unit; do
  timeout 45 ncu $SECTIONS --kernel-name regex:tensor_q4 --launch-skip 2 --launch-count 1 -f -o $OUT/Y/ncu-$v python3 .sweep/s54/ncu_variant.py $v 6656 39936 16 > $OUT/Y/ncu-$v.log 2>&1; echo ncu $v rc=$?
  ncu -i $OUT/Y/ncu-$v.ncu-rep --page details > $OUT/Y/ncu-$v-details.txt 2>&1
  ncu -i $OUT/Y/ncu-$v.ncu-rep --page source --csv --print-source sass > $OUT/Y/ncu-$v-sass.csv 2>&1; gzip $OUT/Y/ncu-$v-sass.csv
  rm -f $OUT/Y/ncu-$v.ncu-rep
  grep -E "Duration|DRAM Throughput|L1/TEX Hit|Mem Pipes Busy|Issued Warp|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|Executed Instructions  |uncoalesced|excessive" $OUT/Y/ncu-$v-details.txt | head -14 | cut -c1-220
done
cd $OUT && tar czf Y.tgz Y && rm -rf Y
