#!/bin/bash
# session 43, call F: what the #include lines save -- benchmarks.launch_cost (host us a call: build, eval) with the texts
# inline (DFLASH_INCLUDED_TEXTS=0) and included (=1), alternating, two processes each; then the loop (4-bit full-size
# Glimmer, 4k, replay tau 6, default pacing), one process each way, every run checked lossless.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-F.txt 2>&1
for run in 1 2; do
  for inc in 0 1; do
    DFLASH_INCLUDED_TEXTS=$inc timeout 60 python3 -m benchmarks.launch_cost --calls 200 --reps 7 --json $OUT/F-launch-inc$inc-run$run.json > $OUT/F-launch-inc$inc-run$run.txt 2>&1; echo launch inc=$inc run=$run rc=$?
  done
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
rows = {}
for run in (1, 2):
    for inc in (0, 1):
        try:
            d = json.load(open(f"{out}/F-launch-inc{inc}-run{run}.json"))
        except Exception as e:
            print(inc, run, e); continue
        for r in d["rows"] if isinstance(d, dict) else d:
            rows.setdefault(r["op"], {})[(inc, run)] = (r["build_us"], r["eval_us"])
for op, v in rows.items():
    print(f"{op[:40]:40s}", "  ".join(f"inc{k[0]}r{k[1]} b{b:6.1f} e{e:6.1f}" for k, (b, e) in sorted(v.items())))
PY
A="--scale full --quant 4bit --context 4096 --tokens 96 --arms 0 --reps 4"
for inc in 0 1; do
  DFLASH_INCLUDED_TEXTS=$inc timeout 170 python3 -m benchmarks.pacing_ab $A --json $OUT/F-loop-inc$inc.json 2>&1 | grep -v Warning | tail -3; echo loop inc=$inc rc=$?
done
python3 - <<'PY'
import json, os, statistics
for inc in (0, 1):
    try:
        d = json.load(open(os.environ["OUT"] + f"/F-loop-inc{inc}.json"))
    except Exception as e:
        print(inc, e); continue
    print("included" if inc else "inline", "plain", round(statistics.median(d["plain_ms"]), 1), "median", d["median_ms"], "x_plain", d["x_plain"], "rounds", d["round_median_ms"], "lossless", d["all_lossless"], "total", d["total_s"])
PY
