#!/bin/bash
# session 44, call D (run inline as this command): the dense bf16 small-row matmul (a bf16 target's and the
# drafter's projections) against mlx's matmul (cuBLAS), 16 and 1 rows, with plan and layout variants.
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1; mkdir -p $OUT
S="o_proj;mlp down;attn q/k/v/gate fused;mlp gate+up fused;drafter q/k/v fused;drafter fc"
timeout 220 python3 -m benchmarks.matmul_variants --dense --rows 16,1 --reps 20 --shapes "$S" --variants current,memonly,dense-overhead4,dense-overhead8,waves132,kgroups1 --json $OUT/D-dense.json > $OUT/D-dense.txt 2>&1; echo dense rc=$?
