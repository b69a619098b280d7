#!/bin/bash
# session 41, call D: the merge of a K split with its loads in flight against session 40's (same bits), the wave rule's fixed cost, then the CUDA matmul tests and the kernel patch's bitwise agreement on the new texts.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/t
python3 -c "from dflash.metal import tensor_qmm as t; print(t.SCALED_SPECS[(2,(4,1),64)].name('cuda'), t.SCALED_SPECS[(2,(4,2),64)].name('cuda'))"
S="mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj"
timeout 240 python3 -m benchmarks.matmul_variants --rows 16,1 --reps 30 --variants current,oldmerge,overhead3,overhead4,oldmerge-overhead4,noepilogue,waves132 --shapes "$S" --json $OUT/D-variants.json > $OUT/D-variants.txt 2>&1; echo variants rc=$?
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/D-variants.json"))
for r in d["rows"]:
    print(f'{r["rows"]:2d} {r["projection"][:22]:22s} {r["variant"]:20s} {r["device_us"]:8.2f} {r["over_bound"]:5.2f}x k={r["kernels_per_call"]} d={r["max_abs_diff_vs_mlx"]}')
print("errors", d.get("errors"))
PY
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_qmm.py -m cuda > $OUT/t/test_tensor_qmm.txt 2>&1 &
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_patch.py -k "plain_and_speculative_logits_agree_bitwise or compiled_forwards_give_the_uncompiled_bits" > $OUT/t/test_kernel_patch.txt 2>&1 &
wait
for f in $OUT/t/*.txt; do echo "== $(basename $f) $(grep -E 'passed|failed|error' $f | tail -1)"; grep -E "^(FAILED|ERROR)" $f | head -5 | cut -c1-250; done | tee $OUT/D-pytest-summary.txt
tar czf $OUT/D-pytest.tgz -C $OUT t && rm -r $OUT/t
