#!/bin/bash
# session 41, call A: what paces the 4-bit matmul's copies (diagnostic variants, 16 rows), and the SASS of the shipped 4-bit scaled kernel.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu-A.txt 2>&1
for t in cuobjdump nvdisasm; do (which $t || ls /usr/local/cuda*/bin/$t) 2>&1 | head -2; done
D=$( (which cuobjdump || ls /usr/local/cuda*/bin/cuobjdump) 2>/dev/null | head -1)
if [ -n "$D" ]; then $D -sass .sweep/s41/qmm_q4_m1_scaled_g64_k2.cubin > $OUT/A-sass.txt 2>&1; echo sass rc=$? lines $(wc -l < $OUT/A-sass.txt); fi
V=current,computeonly,memonly,memonly-nox,skeleton,memonly-nox-x0,memonly-nox-x0-s6,memonly-1cta-s6,memonly-nox-x0-1cta-s8,1cta-s4,1cta-s6
timeout 420 python3 -m benchmarks.matmul_variants --rows 16 --reps 20 --variants $V --shapes "mlp gate+up fused;mlp down;attn q/k/v/gate fused;o_proj" --json $OUT/A-variants16.json > $OUT/A-variants16.txt 2>&1; echo variants rc=$?
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/A-variants16.json"))
for r in d["rows"]:
    print(f'{r["projection"][:22]:22s} {r["variant"]:24s} {r["device_us"]:8.2f} {r["over_bound"]:5.2f}x k={r["kernels_per_call"]}')
print("errors", d.get("errors"))
PY
grep -i "error" $OUT/A-variants16.txt | head -5 | cut -c1-300
