#!/bin/bash
# session 33, call B: the scheduled-sets fix A/B and host diagnostics (loop_ab2.py), then the CUDA test files.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
lscpu | grep -E "Model name|Socket|Thread|Core|NUMA node\(s\)|MHz" > $OUT/B-cpu.txt; cat $OUT/B-cpu.txt
timeout 370 python3 .sweep/s33/loop_ab2.py $OUT/B-loop.json > $OUT/B-loop.txt 2>&1; echo loop rc=$?
grep -E "^cupti" $OUT/B-loop.txt | cut -c1-520
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/B-loop.json"))
for r in d["runs"]:
    p = r.get("phases", {})
    print(f'{r["arm"]:22s} {r["decode_ms"]:7.1f} lossless={r["lossless"]} round={p.get("round")} wait={p.get("wait")} draft={p.get("draft")} dl={p.get("draft_launch")} vg={p.get("verify_graph")} vl={p.get("verify_launch")}')
print(json.dumps(d.get("summary", {}))[:1200])
print(json.dumps(d.get("pinning", {}))[:800])
print(json.dumps(d.get("host_made", {}))[:1500])
for m in d.get("make_cost", []): print(m)
PY
head -40 $OUT/B-cprofile-tottime.txt | tail -30 | cut -c1-150
mkdir -p $OUT/t
for f in tests/test_gated_mlp.py tests/test_head_prep.py tests/test_metal_cuda.py tests/test_residual_norm.py tests/test_tensor_attention.py tests/test_traced_layers.py tests/test_verify_kernels.py tests/test_wired_cache.py tests/test_bucketed_keys.py; do
  timeout 140 python3 -m pytest -q -p no:cacheprovider $f -m cuda > $OUT/t/$(basename $f .py).txt 2>&1 &
done
wait
for f in $OUT/t/*.txt; do echo "== $(basename $f) $(grep -E 'passed|failed|error' $f | tail -1)"; grep -E "^(FAILED|ERROR)" $f | head -3 | cut -c1-200; done | tee $OUT/B-pytest-summary.txt
tar czf $OUT/B-pytest.tgz -C $OUT t && rm -r $OUT/t
