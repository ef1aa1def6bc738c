#!/usr/bin/env bash
# Install llama-cpp-python (the gguf target's runtime: pit_deploy/targets/gguf/__init__.py) into .venv,
# built from its PyPI sdist. PyPI has no CPU wheel of it, and a wheel built elsewhere may not use this
# CPU's instruction set; llama.cpp's default build targets the machine it is built on. The build takes
# several minutes on two cores, so the wheel is built once into a cache and installed from there:
#   ${PIT_DEPLOY_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pit_deploy/wheels}
# Idempotent: nothing happens when the pinned version is installed; a cached wheel is reused.
# A cache shared between machines with different CPUs should be keyed by the caller (set the variable).
# Quiet unless something fails; a failure prints one `error:` line, exit 2.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.3.36
python=${PIT_DEPLOY_PYTHON:-.venv/bin/python}
cache=${PIT_DEPLOY_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pit_deploy/wheels}

fail() {
  echo "error: $*" >&2
  exit 2
}

[ -x "$python" ] || fail "setup_llama_cpp: $python not found; run bash scripts/setup.sh first"
have=$("$python" -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))" 2>/dev/null || true)
[ "$have" = "$version" ] && exit 0
command -v cmake >/dev/null 2>&1 || fail "setup_llama_cpp: cmake is not on PATH (apt-get install cmake)"
command -v c++ >/dev/null 2>&1 || fail "setup_llama_cpp: no C++ compiler on PATH (apt-get install g++)"
mkdir -p "$cache" || fail "setup_llama_cpp: cannot create the wheel cache $cache"
wheel=$(ls "$cache"/llama_cpp_python-"$version"-*.whl 2>/dev/null | head -n1 || true)
log=$(mktemp)
if [ -z "$wheel" ]; then
  src=$(mktemp -d)
  # the sdist only (--no-binary :all:), then a wheel built here with as many jobs as cores
  if ! "$python" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$src" >"$log" 2>&1 ||
     ! CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} "$python" -m pip wheel --quiet --no-deps \
         --no-binary llama-cpp-python -w "$src/wheel" "$src"/llama_cpp_python-"$version".tar.gz >"$log" 2>&1; then
    msg=$(grep -m1 -i 'error' "$log" || tail -n1 "$log")
    rm -rf "$src" "$log"
    fail "setup_llama_cpp: building llama-cpp-python $version from its sdist failed: ${msg:-no output}"
  fi
  cp "$src"/wheel/llama_cpp_python-"$version"-*.whl "$cache"/
  rm -rf "$src"
  wheel=$(ls "$cache"/llama_cpp_python-"$version"-*.whl | head -n1)
fi
if ! "$python" -m pip install --quiet "$wheel" >"$log" 2>&1; then
  msg=$(grep -m1 -i 'error' "$log" || tail -n1 "$log")
  rm -f "$log"
  fail "setup_llama_cpp: installing $wheel failed: ${msg:-no output}"
fi
rm -f "$log"
