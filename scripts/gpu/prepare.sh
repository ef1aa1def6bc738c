#!/usr/bin/env bash
# Builds the folders that travel to the GPU machine with the prepared runs (git-ignored, under
# build/): run it from a checkout whose .venv has the package and the default model installed.
#
#   build/gpu-common/   site/gguf (the pure-Python GGUF reader transformers needs to load the
#                       default model), tokenizer/ (the default model's tokenizer, for from-scratch
#                       runs), model.sha256 (of the whole default GGUF)          ~ 3 MB
#   build/gpu-part1/    the first half of the default model's GGUF               ~ 47 MB
#   build/gpu-part2/    the second half                                          ~ 47 MB
#
# The GGUF (98 MB) is larger than one transfer (64 MiB with the checkout), so continued
# pretraining sends it in two calls made back to back; from-scratch runs carry build/gpu-common only.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
rm -rf build/gpu-common build/gpu-part1 build/gpu-part2
mkdir -p build/gpu-common/site build/gpu-part1 build/gpu-part2
"$PY" - <<'PYEOF'
import hashlib, os, shutil
from pathlib import Path

import gguf

from pit_deploy.io.sources import default_gguf_path
from pit_deploy.training.loop import load_tokenizer

src = Path(gguf.__file__).parent
shutil.copytree(src, "build/gpu-common/site/gguf", ignore=shutil.ignore_patterns("__pycache__", "scripts", "*.pyc"))
load_tokenizer("default").save_pretrained("build/gpu-common/tokenizer")
path = default_gguf_path()
data = path.read_bytes()
half = len(data) // 2
Path("build/gpu-part1/model.part1").write_bytes(data[:half])
Path("build/gpu-part2/model.part2").write_bytes(data[half:])
Path("build/gpu-common/model.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  {path.name}\n")
for folder in ("build/gpu-common", "build/gpu-part1", "build/gpu-part2"):
    size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    print(f"{folder}: {size / 2**20:.1f} MiB")
PYEOF
checkout=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
echo "checkout sent with every call: $((checkout / 1048576)) MiB"
