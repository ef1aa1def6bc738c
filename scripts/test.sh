#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite.
#
#   bash scripts/test.sh          the default tier (what CI runs): every target x family x mode on
#                                 tiny models, every command and API call, the exit codes, the
#                                 reliability cases, the README blocks on one family, the docs
#   bash scripts/test.sh --full   everything: adds the bundled default model's runtime parity, the
#                                 README block on every family, the notebooks and the whole
#                                 emulated aarch64 verification, --isa aarch64 --full, and the .pte
#                                 lowerings of a second setting of a verified path (run it before
#                                 changing export, quantization or a runtime)
#
# Other arguments go to pytest (e.g. bash scripts/test.sh tests/test_cli.py -k help).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(-m "not full")
args=()
for arg in "$@"; do
  if [ "$arg" = "--full" ]; then tier=(); else args+=("$arg"); fi
done
bash scripts/setup.sh
# the transformers.js checks' npm packages (pinned in web/) and Debian's chromium; the default run needs neither
bash scripts/setup_web.sh
# llama-cpp-python for the gguf target, built once from its sdist into a wheel cache (minutes on 2 cores)
bash scripts/setup_llama_cpp.sh
# qemu 10.x, an arm64 Python and the aarch64 onnxruntime wheels, cached, for verify --isa aarch64
# (the default tier runs the compact check on a tiny model; the whole emulated verification is in the full tier)
bash scripts/setup_aarch64.sh
export HF_HUB_OFFLINE=1
# Two workers (pytest-xdist), one per core of the CI machine; a test file, and the runtime suite as
# a whole, stays on one worker, and the slowest groups are handed out first (tests/conftest.py;
# --no-loadscope-reorder keeps that order), each worker's torch on its share of the cores.
# PIT_TEST_WORKERS=0 runs in this process.
# The 25 slowest tests are listed at the end, to show where the suite's time goes.
exec .venv/bin/python -m pytest -n "${PIT_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder --durations=25 ${tier[@]+"${tier[@]}"} ${args[@]+"${args[@]}"}
