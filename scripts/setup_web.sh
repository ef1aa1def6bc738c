#!/usr/bin/env bash
# Install what pit_deploy/runtime/web_clients.py needs to run exports through transformers.js:
# the npm packages pinned in web/package-lock.json (transformers.js, onnxruntime-node,
# onnxruntime-web) into web/node_modules, and Debian's chromium when none is on PATH.
# Idempotent: `npm ci` runs only when web/node_modules is missing or package-lock.json changed
# since the last successful install (a stamp inside node_modules), and apt-get only when no
# chromium is found. Quiet unless something fails; a failure prints one `error:` line, exit 2.
set -euo pipefail
cd "$(dirname "$0")/.."
web=web

fail() {
  echo "error: $*" >&2
  exit 2
}

# --- npm packages -------------------------------------------------------------------------
command -v node >/dev/null 2>&1 || fail "setup_web: node is not on PATH; install Node.js 20 or newer"
command -v npm >/dev/null 2>&1 || fail "setup_web: npm is not on PATH; install npm (Node.js 20 or newer)"
[ -f "$web/package-lock.json" ] || fail "setup_web: $web/package-lock.json is missing"
stamp=$web/node_modules/.pit-deploy-installed
want=$(cat "$web/package.json" "$web/package-lock.json" | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] ||
   [ ! -f "$web/node_modules/@huggingface/transformers/package.json" ]; then
  log=$(mktemp)
  # ONNXRUNTIME_NODE_INSTALL=skip: onnxruntime-node's install script would otherwise try to
  # download GPU (CUDA/TensorRT) binaries; the CPU binaries ship inside the npm package.
  if ! (cd "$web" && ONNXRUNTIME_NODE_INSTALL=skip npm ci --no-audit --no-fund --loglevel=error >"$log" 2>&1); then
    msg=$(grep -m1 -i 'err' "$log" || tail -n1 "$log")
    rm -f "$log"
    fail "setup_web: npm ci in $web failed: ${msg:-no output}"
  fi
  rm -f "$log"
  echo "$want" > "$stamp"
fi

# --- chromium -----------------------------------------------------------------------------
if [ -n "${PIT_DEPLOY_CHROMIUM:-}" ] || command -v chromium >/dev/null 2>&1 ||
   command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
command -v apt-get >/dev/null 2>&1 ||
  fail "setup_web: chromium is not on PATH and there is no apt-get to install it; install chromium"
sudo=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || fail "setup_web: installing chromium needs root (or sudo)"
  sudo="sudo -n"
fi
log=$(mktemp)
if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium; } >"$log" 2>&1; then
  msg=$(grep -m1 -E '^(E|Err):' "$log" || tail -n1 "$log")
  rm -f "$log"
  fail "setup_web: apt-get install chromium failed: ${msg:-no output}"
fi
rm -f "$log"
command -v chromium >/dev/null 2>&1 || fail "setup_web: apt-get installed chromium but it is not on PATH"
