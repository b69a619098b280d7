#!/usr/bin/env bash
# Reproduce the demo pair on a GPU machine (mlx CUDA backend), one stage per call, each
# under 10 minutes; every stage resumes from its checkpoint when re-run.
#   bash training/pipeline.sh target   DATA WORK OUT   # train + export the target
#   bash training/pipeline.sh drafter  DATA WORK OUT   # distil + train + export the drafter
#   bash training/pipeline.sh raw      DATA WORK OUT   # comparison drafter on raw corpus text
# DATA holds the output of `python -m training.prepare` and of
# `python -m training.distill --cut-only` (both read the local stdlib: run them where
# the corpus was built); WORK keeps checkpoints between calls; OUT receives the exported
# folders and logs.
set -euo pipefail
stage=$1; data=$2; work=$3; out=$4
mkdir -p "$work" "$out"
case "$stage" in
  target)
    python -m training.train_target --data "$data" --checkpoint "$work/ckpt-target" \
      --export "$work/target" --export-from "${EXPORT_FROM:-best}" \
      --run-seconds "${RUN_SECONDS:-480}" 2>&1 | tee "$out/train-target.log"
    if [ -f "$work/target/config.json" ]; then cp -r "$work/target" "$out/"; fi
    ;;
  drafter)
    if [ ! -f "$work/distill/meta.json" ]; then
      python -m training.distill --data "$data" --target "$work/target" --out "$work/distill" \
        --seconds "${DISTILL_SECONDS:-200}" --batch "${DISTILL_BATCH:-1024}" \
        --prompt-source "${PROMPT_SOURCE:-mixed}" 2>&1 | tee "$out/distill.log"
    fi
    python -m training.train_drafter --data "$data" --target "$work/target" \
      --distill "$work/distill" --checkpoint "$work/ckpt-drafter" --export "$work/drafter" \
      --run-seconds "${RUN_SECONDS:-420}" 2>&1 | tee "$out/train-drafter.log"
    if [ -f "$work/drafter/config.json" ]; then cp -r "$work/drafter" "$out/"; fi
    ;;
  raw)
    python -m training.train_drafter --source raw --data "$data" --target "$work/target" \
      --distill "$work/distill" --checkpoint "$work/ckpt-drafter-raw" \
      --total-steps "${TOTAL_STEPS:?set TOTAL_STEPS to the greedy run total}" \
      --run-seconds "${RUN_SECONDS:-150}" 2>&1 | tee "$out/train-drafter-raw.log"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
