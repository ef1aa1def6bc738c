#!/usr/bin/env bash
# Set up .venv (if needed) and run the whole test suite: unit tests and the runtime parity suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest "$@"
