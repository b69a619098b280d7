#!/bin/bash
# session 30, call C: the wide layout on the H200 (its `cuda` tests), Nsight Compute of it against stream, the loop A/B.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-C.txt 2>&1
P="python3 -m pytest -q -p no:cacheprovider tests/test_tensor_attention.py -m cuda"
timeout 240 $P -k matches_oracle_and_reference > $OUT/C-pytest-oracle.txt 2>&1 &
timeout 240 $P -k batch_invariant > $OUT/C-pytest-invariant.txt 2>&1 &
timeout 240 $P -k seam > $OUT/C-pytest-seam.txt 2>&1 &
timeout 240 $P -k "not matches_oracle_and_reference and not batch_invariant and not seam" > $OUT/C-pytest-rest.txt 2>&1 &
wait
for f in $OUT/C-pytest-*.txt; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $f | tail -4 | cut -c1-300; done
SECTIONS="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats"
for case in "4096 growing 16 8 wide" "4096 growing 1 8 wide" "4096 growing 1 8 stream" "4096 ring 16 8 wide" "4096 ring 16 8 stream" "32768 growing 16 8 wide" "32768 growing 16 8 stream"; do
  tag=$(echo $case | cut -d' ' -f1-3,5 | tr ' ' '-')
  timeout 60 ncu $SECTIONS --kernel-name regex:"attend_chunks|fold" --launch-skip 6 --launch-count 2 -f -o /tmp/C-ncu-$tag python3 .sweep/s30/ncu_attention.py $case > /tmp/C-ncu-$tag.log 2>&1; echo ncu $tag rc=$?
  ncu -i /tmp/C-ncu-$tag.ncu-rep --page details > $OUT/C-ncu-$tag-details.txt 2>&1
  grep -E "dflash|Duration|Elapsed Cycles|Registers Per|Grid Size|Warp Cycles Per Issued" $OUT/C-ncu-$tag-details.txt | head -12 | cut -c1-120
done
S30_ARMS=wide timeout 250 python3 .sweep/s30/loop_probe.py $OUT/C-loop.json > $OUT/C-loop.txt 2>&1; echo loop rc=$?; tail -22 $OUT/C-loop.txt | cut -c1-300
