#!/usr/bin/env bash
# Install llama-cpp-python (the gguf target's runtime: pit_deploy/targets/gguf/__init__.py) into .venv,
# built from its PyPI sdist. PyPI has no CPU wheel of it, and a wheel built elsewhere may not use this
# CPU's instruction set; llama.cpp's default build targets the machine it is built on. The build takes
# several minutes on two cores, so the wheel is built once into a cache and installed from there:
#   ${PIT_DEPLOY_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pit_deploy/wheels}
# Idempotent: nothing happens when the pinned version is installed; a cached wheel is reused.
# Inside the cache, a wheel is kept per CPU (below), so one cache can serve machines with different CPUs.
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
# The build targets this CPU (-march=native), so the cache is kept per CPU: the features the compiler
# enables natively, and whether AMX code built by this compiler runs. On a CPU with AMX, ggml's AMX
# matmul loads a tile configuration it fills in a local struct; GCC 12's _tile_loadconfig tells the
# optimizer that it reads only 8 bytes of it, so at -O2 and above the rest of the configuration is
# never stored and the first tile instruction faults (SIGILL: the process dies). The probe below is
# that pattern; where it fails (or the kernel does not grant AMX), AMX is left out (-mno-amx-*).
native=$(c++ -march=native -Q --help=target 2>/dev/null | awk '$1 ~ /^-m/ && $2 == "[enabled]" {print $1}' | sort | tr '\n' ' ')
no_amx=""
if [[ " $native " == *" -mamx-tile "* ]]; then
  probe=$(mktemp -d)
  cat >"$probe/amx.c" <<'C'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
  unsigned char cfg[64];
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return 1;
  memset(cfg, 0, sizeof cfg);
  cfg[0] = 1;
  for (int t = 0; t < 8; t++) { cfg[16 + 2 * t] = 64; cfg[48 + t] = 16; }
  _tile_loadconfig(cfg);
  _tile_zero(0);
  _tile_release();
  return 0;
}
C
  if ! { c++ -x c++ -O3 -mamx-tile -o "$probe/amx" "$probe/amx.c" && ("$probe/amx"; exit $?); } >/dev/null 2>&1; then
    for isa in amx-tile amx-int8 amx-bf16 amx-fp16 amx-complex; do
      [[ " $native " == *" -m$isa "* ]] && no_amx+=" -mno-$isa"
    done
  fi
  rm -rf "$probe"
fi
cache="$cache/$(printf '%s|%s' "$native" "$no_amx" | sha256sum | cut -c1-16)"
mkdir -p "$cache" || fail "setup_llama_cpp: cannot create the wheel cache $cache"
wheel=$(ls "$cache"/llama_cpp_python-"$version"-*.whl 2>/dev/null | head -n1 || true)
log=$(mktemp)
if [ -z "$wheel" ]; then
  src=$(mktemp -d)
  # the sdist only (--no-binary :all:), then a wheel built here with as many jobs as cores
  if ! "$python" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$src" >"$log" 2>&1 ||
     ! CMAKE_ARGS="${CMAKE_ARGS:-}${no_amx:+ -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'}" \
       CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} "$python" -m pip wheel --quiet --no-deps \
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
