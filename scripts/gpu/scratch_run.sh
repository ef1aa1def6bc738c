#!/usr/bin/env bash
# From-scratch pretraining of the default model's shape, PIT against TT, then LoRA of each, on
# the GPU machine (one call, carrying build/gpu-common for the default tokenizer).
# Writes $OUT/gpu_scratch.json and $OUT/gpu_scratch.log. PIT_GPU_SMOKE=1: a tiny model on the CPU.
set -uo pipefail
source "$(dirname "$0")/common.sh"
name=gpu_scratch
args=(scratch --out "$OUT" --budget-s "${PIT_GPU_BUDGET_S:-540}")
if smoke; then
    name=gpu_scratch_smoke
    args=(scratch --out "$OUT")
else
    if [ ! -f build/gpu-common/tokenizer/tokenizer.json ]; then
        echo "error: build/gpu-common/tokenizer is missing: run bash scripts/gpu/prepare.sh and carry build/gpu-common" | tee "$OUT/$name.log"
        exit 2
    fi
    args+=(--tokenizer build/gpu-common/tokenizer)
fi
"$PY" scripts/gpu/gpu_run.py "${args[@]}" "$@" 2>&1 | tee "$OUT/$name.log"
exit "${PIPESTATUS[0]}"
