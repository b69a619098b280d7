#!/bin/bash
# Session 60, call 2: where the host's time goes in a 4-bit tau-6 decode now (py-spy --native
# attached for the timed decodes only), as session 34 did on the H200.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/S
chmod +x .sweep/s60/py-spy
lscpu | grep -E "Model name|MHz" > $OUT/S/cpu.txt
SPY_BIN=.sweep/s60/py-spy SPY_OUT=$OUT/S/spy.txt SPY_RATE=${RATE:-200} SPY_SECONDS=${SECS:-9} timeout 330 python3 .sweep/s60/spy_decode.py $OUT/S/spy.json ${RUNS:-10} > $OUT/S/spy.log 2>&1
echo "rc=$?"; grep -v Warning $OUT/S/spy.log | grep -E "plain|decode_ms|Error|error|setup" | cut -c1-200 | tail -14
[ -s $OUT/S/spy.txt ] && python3 .sweep/s60/fold_spy.py $OUT/S/spy.txt > $OUT/S/fold.txt && grep -A45 "== inclusive" $OUT/S/fold.txt | cut -c1-150
