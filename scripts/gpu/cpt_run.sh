#!/usr/bin/env bash
# Continued pretraining, PIT against TT, on the GPU machine (the second call: it carries
# build/gpu-common and build/gpu-part2; build/gpu-part1 is still there from the first call).
# Reassembles the default model's GGUF, checks its SHA-256, runs scripts/gpu/gpu_run.py cpt.
# Writes $OUT/gpu_cpt.json and $OUT/gpu_cpt.log. PIT_GPU_SMOKE=1: a tiny model on the CPU.
set -uo pipefail
source "$(dirname "$0")/common.sh"
args=(cpt --out "$OUT" --budget-s "${PIT_GPU_BUDGET_S:-480}")
name=gpu_cpt
if smoke; then
    name=gpu_cpt_smoke
    args=(cpt --out "$OUT")
else
    for part in build/gpu-part1/model.part1 build/gpu-part2/model.part2 build/gpu-common/model.sha256; do
        if [ ! -f "$part" ]; then
            echo "error: $part is missing: make the first call (scripts/gpu/preflight.sh, carrying build/gpu-common and build/gpu-part1) right before this one" | tee "$OUT/$name.log"
            exit 2
        fi
    done
    mkdir -p build/gpu-model
    model="build/gpu-model/$(awk '{print $2}' build/gpu-common/model.sha256)"
    cat build/gpu-part1/model.part1 build/gpu-part2/model.part2 > "$model"
    (cd build/gpu-model && awk '{print $1 "  " $2}' ../gpu-common/model.sha256 | sha256sum -c -) || {
        echo "error: the reassembled GGUF does not match its SHA-256" | tee "$OUT/$name.log"; exit 2; }
    args+=(--model "$model")
fi
"$PY" scripts/gpu/gpu_run.py "${args[@]}" "$@" 2>&1 | tee "$OUT/$name.log"
exit "${PIPESTATUS[0]}"
