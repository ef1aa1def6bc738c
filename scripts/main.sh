#!/usr/bin/env bash
# Set up .venv (if needed) and run the pipeline on the bundled default model
# (SmolLM2-135M-Instruct) and corpus: `pit-deploy run` with the default recipe — convert to PIT,
# a short continued pretraining, export to ONNX and ExecuTorch, verify on both runtimes,
# benchmark, and write the report. A rerun skips what is up to date; an interrupted run resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
out=${1:-runs/default}
shift || true
exec .venv/bin/pit-deploy run default --out "$out" "$@"
