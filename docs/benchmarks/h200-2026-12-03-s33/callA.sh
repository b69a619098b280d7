#!/bin/bash
# session 33, call A: tools, the CUDA scalar tests (resident token ids), then the loop A/B probe.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
(which nsys ncu; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,pstate --format=csv) > $OUT/A-tools.txt 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_metal_cuda.py -m cuda > $OUT/A-pytest.txt 2>&1; tail -2 $OUT/A-pytest.txt
timeout 430 python3 .sweep/s33/loop_ab.py $OUT/A-loop.json > $OUT/A-loop.txt 2>&1; echo loop rc=$?
grep -E "^cupti" $OUT/A-loop.txt | cut -c1-700
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/A-loop.json"))
for r in d["runs"]:
    p = r.get("phases", {})
    print(f'{r["arm"]:24s} {r["decode_ms"]:7.1f} lossless={r["lossless"]} round={p.get("round")} wait={p.get("wait")} draft={p.get("draft")} dl={p.get("draft_launch")} vg={p.get("verify_graph")} vl={p.get("verify_launch")} settle={p.get("settle")}')
print(json.dumps(d.get("summary", {}))[:1500])
PY
