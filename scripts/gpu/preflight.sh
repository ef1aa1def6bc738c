#!/usr/bin/env bash
# The first call of continued pretraining on the GPU machine (it carries build/gpu-common and
# build/gpu-part1): what is installed there, and the whole continued-pretraining script on a
# tiny model on the GPU (bf16, eager) for a few steps, in well under a minute.
# Writes $OUT/preflight/gpu_cpt_smoke.json and $OUT/preflight.log.
set -uo pipefail
source "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/preflight.log"
ls -l build/gpu-part1 build/gpu-common 2>&1 | tee -a "$OUT/preflight.log"
PIT_GPU_SMOKE=1 "$PY" scripts/gpu/gpu_run.py cpt --out "$OUT/preflight" --no-verify \
    --set 'train.device="auto"' --set 'train.precision="bf16"' \
    --set train.steps=10 --set train.eval_every=5 "$@" 2>&1 | tail -n 200 | tee -a "$OUT/preflight.log"
exit "${PIPESTATUS[0]}"
