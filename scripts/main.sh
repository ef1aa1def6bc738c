#!/usr/bin/env bash
# Set up .venv (if needed) and run the main job on the bundled default model
# (SmolLM2-135M-Instruct): convert it to PIT and diagnose the token interface before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
out=${1:-runs/smollm2-pit}
.venv/bin/pit-deploy diagnose default
.venv/bin/pit-deploy convert --model default --out "$out" --t-init output --force
.venv/bin/pit-deploy diagnose "$out"
