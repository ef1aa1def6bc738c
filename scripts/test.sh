#!/usr/bin/env bash
# Set up .venv (if needed) and run the whole test suite: unit tests and the runtime parity suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the transformers.js checks' npm packages (pinned in web/) and Debian's chromium; the main job needs neither
bash scripts/setup_web.sh
# llama-cpp-python for the gguf target, built once from its sdist into a wheel cache (minutes on 2 cores)
bash scripts/setup_llama_cpp.sh
# qemu 10.x, an arm64 Python and the aarch64 onnxruntime wheels, cached, for verify --isa aarch64
bash scripts/setup_aarch64.sh
export HF_HUB_OFFLINE=1
# Two workers (pytest-xdist), one per core of the CI machine; a test file, and the runtime suite as
# a whole, stays on one worker (tests/conftest.py). PIT_TEST_WORKERS=0 runs in this process.
# The 25 slowest tests are listed at the end, to show where the suite's time goes.
exec .venv/bin/python -m pytest -n "${PIT_TEST_WORKERS:-2}" --dist loadgroup --durations=25 "$@"
