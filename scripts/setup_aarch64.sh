#!/usr/bin/env bash
# Install what `pit-deploy verify --isa aarch64` needs to run artifacts on the runtimes' aarch64
# kernels under user-mode emulation, on an x86-64 Debian machine (pit_deploy/runtime/emulated.py):
#   - qemu's static aarch64 user-mode emulator, 10.x, from Debian's bookworm-backports (package
#     qemu-user), unpacked into the cache: bookworm's own qemu-user-static 7.2 crashes in `import
#     onnxruntime` (it shows the guest the host's /proc/cpuinfo); the apt source is added when missing,
#     on the mirror the machine's own Debian sources already use;
#   - an arm64 Python 3.11: Debian's arm64 packages, downloaded and unpacked (no binfmt, no chroot;
#     qemu runs it with QEMU_LD_PREFIX and PYTHONHOME pointing at that root);
#   - the pinned aarch64 wheels (onnxruntime, numpy, onnxruntime-genai), installed from this side
#     with pip --target into site/;
#   - for the ExecuTorch programs (.pte): the pinned aarch64 wheels of torch, executorch, torchao and
#     the pure-Python packages they import, into their own site-executorch/ (the ONNX jobs keep their
#     small import path), libatomic1:arm64 in the sysroot, and stubs/: stand-ins for the CUDA
#     libraries PyPI's aarch64 torch (a CUDA build) links, built here by scripts/aarch64_cuda_stubs.py
#     with the aarch64 assembler and linker of Debian's binutils-aarch64-linux-gnu (downloaded and
#     unpacked for the build, not installed), in place of about 3 GB of nvidia-* wheels.
#     pip keeps its download cache (~/.cache/pip): a machine that keeps it does not download the
#     427 MB torch wheel again.
# Everything goes into ${PIT_DEPLOY_AARCH64_ROOT:-$HOME/.cache/pit_deploy/aarch64}; setup.json there
# records what was installed and is what pit-deploy reads. Idempotent: a rerun with the same pins
# checks the stamp and exits at once. Quiet unless something fails; a failure prints one `error:`
# line naming what could not be had, exit 2 ("unsupported platform: ..." where this machine cannot run it:
# not x86-64, not Debian bookworm, no apt-get, no root).
set -euo pipefail
cd "$(dirname "$0")/.."
ort_version=1.31.1
numpy_version=2.4.6
genai_version=0.18.0
qemu_major=10
torch_version=2.13.0
executorch_version=1.5.1
torchao_version=0.18.0
# what torch, executorch and torchao import (pinned: the set-up is reproducible)
et_deps="typing_extensions==4.16.0 sympy==1.14.0 mpmath==1.3.0 filelock==4.3.1 jinja2==3.1.6 markupsafe==3.0.4
networkx==3.6.1 fsspec==2026.9.0 setuptools==84.2.1 ruamel.yaml==0.19.1 tabulate==0.10.0 tqdm==4.70.1
wcwidth==0.9.4 PyYAML==6.0.4"
stubs_script=scripts/aarch64_cuda_stubs.py
python=${PIT_DEPLOY_PYTHON:-.venv/bin/python}
root=${PIT_DEPLOY_AARCH64_ROOT:-$HOME/.cache/pit_deploy/aarch64}
# the arm64 Debian packages an onnxruntime/numpy Python needs (python3.11-minimal and the libraries
# its standard library and the wheels link)
debs="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libgcc-s1 libstdc++6 zlib1g
libexpat1 libssl3 libffi8 libbz2-1.0 liblzma5 libuuid1 libsqlite3-0 libncursesw6 libtinfo6 libreadline8
libcrypt1 libdb5.3 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libcom-err2
libkrb5support0 libkeyutils1 libatomic1"

fail() {
  echo "error: setup_aarch64: $*" >&2
  exit 2
}

stamp=$root/.pit-deploy-installed
want=$(printf '%s\n' "$ort_version" "$numpy_version" "$genai_version" "$qemu_major" "$debs" \
  "$torch_version" "$executorch_version" "$torchao_version" "$et_deps" \
  | cat - "$0" "$stubs_script" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f "$root/setup.json" ] &&
   [ -x "$root/bin/qemu-aarch64" ] && [ -d "$root/site-executorch/executorch" ]; then
  exit 0
fi

[ "$(uname -m)" = x86_64 ] || fail "unsupported platform: this set-up is for x86-64 hosts (this one is $(uname -m)); on an aarch64 machine run the runtimes natively"
command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1 ||
  fail "unsupported platform: needs Debian's apt-get and dpkg (bookworm): qemu $qemu_major.x and an arm64 Python cannot be had without them"
[ -x "$python" ] || fail "$python not found; run bash scripts/setup.sh first"
sudo=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || fail "unsupported platform: adding the arm64 architecture and the backports source needs root (or sudo)"
  sudo="sudo -n"
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
apt_quiet() {  # apt-get, waiting for a lock another install holds
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get -qq -o DPkg::Lock::Timeout=900 "$@" >>"$log" 2>&1
}
apt_error() {
  grep -m1 -E '^(E|Err|W):' "$log" || tail -n1 "$log"
}

# --- apt: the backports source and the arm64 architecture --------------------------------------
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
[ "$codename" = bookworm ] || fail "unsupported platform: needs Debian bookworm (this is '${codename:-unknown}'): the pinned qemu comes from bookworm-backports"
changed=0
if ! grep -rqsE '(^|[[:space:]])bookworm-backports([[:space:]]|$)' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  # the mirror of the machine's own bookworm source (deb822 .sources or a one-line .list)
  mirror=$(awk '/^URIs:/ {u=$2} /^Suites:/ && / bookworm( |$)/ && u {print u; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  if [ -z "$mirror" ]; then
    mirror=$(awk '$1 == "deb" && $0 ~ / bookworm( |$)/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' \
      /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -n1 || true)
  fi
  [ -n "$mirror" ] || fail "no Debian bookworm source in /etc/apt to take the mirror of bookworm-backports from"
  printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$mirror" | $sudo tee /etc/apt/sources.list.d/pit-deploy-backports.sources >/dev/null ||
    fail "cannot write /etc/apt/sources.list.d/pit-deploy-backports.sources"
  changed=1
fi
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $sudo dpkg --add-architecture arm64 || fail "dpkg --add-architecture arm64 failed"
  changed=1
fi
if [ "$changed" = 1 ] || ! apt-cache policy qemu-user 2>/dev/null | grep -q bookworm-backports ||
   ! apt-cache show python3.11-minimal:arm64 >/dev/null 2>&1; then
  apt_quiet update || fail "apt-get update failed: $(apt_error)"
fi

# --- downloads: qemu (amd64) and the arm64 Python ---------------------------------------------
work=$(mktemp -d)
trap 'rm -f "$log"; rm -rf "$work"' EXIT
qemu_version=$(apt-cache madison qemu-user 2>/dev/null | awk -F'|' '/bookworm-backports/ {gsub(/ /, "", $2); print $2; exit}')
case "$qemu_version" in
  *:$qemu_major.*|$qemu_major.*) ;;
  *) fail "bookworm-backports offers no qemu-user $qemu_major.x (found '${qemu_version:-none}')" ;;
esac
arm_debs=""
for p in $debs; do arm_debs="$arm_debs $p:arm64"; done
# shellcheck disable=SC2086
(cd "$work" && apt_quiet download "qemu-user=$qemu_version" binutils-aarch64-linux-gnu $arm_debs) ||
  fail "apt-get download of qemu-user $qemu_version, binutils-aarch64-linux-gnu and the arm64 Python packages failed: $(apt_error)"

new=$root.new
rm -rf "$new"
mkdir -p "$new/bin" "$new/sysroot" "$new/site" "$new/site-executorch" "$new/stubs" || fail "cannot create $new"
dpkg-deb -x "$work"/qemu-user_*_amd64.deb "$work/qemu" || fail "cannot unpack qemu-user"
cp "$work/qemu/usr/bin/qemu-aarch64" "$new/bin/qemu-aarch64" 2>/dev/null ||
  fail "qemu-user $qemu_version holds no usr/bin/qemu-aarch64"
for deb in "$work"/*_arm64.deb; do
  dpkg-deb -x "$deb" "$new/sysroot" || fail "cannot unpack $(basename "$deb")"
done
qemu=$new/bin/qemu-aarch64
dpkg-deb -x "$work"/binutils-aarch64-linux-gnu_*_amd64.deb "$work/binutils" || fail "cannot unpack binutils-aarch64-linux-gnu"

# --- the aarch64 wheels ----------------------------------------------------------------------
pip_arm() {
  local target=$1
  shift
  "$python" -m pip install --quiet --disable-pip-version-check --no-compile --target "$target" --upgrade \
    --only-binary=:all: --implementation cp --python-version 3.11 --platform manylinux_2_28_aarch64 "$@" >>"$log" 2>&1
}
pip_error() {
  grep -m1 -i error "$log" || tail -n1 "$log"
}
pip_arm "$new/site" "onnxruntime==$ort_version" "numpy==$numpy_version" ||
  fail "pip could not install the aarch64 wheels onnxruntime==$ort_version numpy==$numpy_version: $(pip_error)"
genai=$genai_version
pip_arm "$new/site" --no-deps "onnxruntime-genai==$genai_version" || genai=""  # optional: verify runs the ONNX graphs without it
# torch, executorch and their imports, each pinned (--no-deps: torch's CUDA wheels stay out); the
# small packages' aarch64 builds carry older manylinux tags, which pip takes only when named
tags=""
for v in $(seq 17 27); do tags="$tags --platform manylinux_2_${v}_aarch64"; done
# shellcheck disable=SC2086
pip_arm "$new/site-executorch" --no-deps --platform manylinux2014_aarch64 --platform linux_aarch64 $tags \
  "torch==$torch_version" "executorch==$executorch_version" "torchao==$torchao_version" $et_deps ||
  fail "pip could not install the aarch64 wheels torch==$torch_version executorch==$executorch_version torchao==$torchao_version and their imports: $(pip_error)"

# --- stand-ins for the CUDA libraries torch links ----------------------------------------------
LD_LIBRARY_PATH=$work/binutils/usr/lib/x86_64-linux-gnu "$python" "$stubs_script" \
  --binutils "$work/binutils/usr/bin/aarch64-linux-gnu-" --sysroot "$new/sysroot" --out "$new/stubs" \
  "$new/site-executorch" >>"$log" 2>&1 || fail "cannot build the CUDA stand-in libraries: $(tail -n1 "$log")"

# Byte-compiled once here: Debian compiles its packages' modules at install time, which unpacking skips,
# and every emulated start would otherwise compile the standard library, numpy and onnxruntime again
# (seconds each under emulation). Bytecode does not depend on the ISA; any CPython 3.11 writes it.
compiler=$python
"$compiler" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null ||
  compiler="env QEMU_LD_PREFIX=$new/sysroot PYTHONHOME=$new/sysroot/usr $new/bin/qemu-aarch64 $new/sysroot/usr/bin/python3.11"
$compiler -m compileall -q -j 0 "$new/sysroot/usr/lib/python3.11" "$new/site" "$new/site-executorch" >/dev/null 2>&1 || true

# --- check: onnxruntime imports and runs in the emulated Python ------------------------------
probe=$(QEMU_LD_PREFIX=$new/sysroot PYTHONHOME=$new/sysroot/usr PYTHONPATH=$new/site PYTHONNOUSERSITE=1 QEMU_CPU=max \
  "$qemu" "$new/sysroot/usr/bin/python3.11" -c \
  'import platform, numpy, onnxruntime; print(platform.machine(), onnxruntime.__version__, numpy.__version__)' 2>>"$log") ||
  fail "the emulated arm64 Python cannot import onnxruntime: $(tail -n1 "$log")"
[ "$probe" = "aarch64 $ort_version $numpy_version" ] || fail "the emulated arm64 Python reports '$probe', not 'aarch64 $ort_version $numpy_version'"
# the ExecuTorch runtime, imported as verify imports it: torch on the stand-ins, no GPU (under a
# minute of emulation)
probe=$(QEMU_LD_PREFIX=$new/sysroot PYTHONHOME=$new/sysroot/usr PYTHONPATH=$new/site-executorch:$new/site PYTHONNOUSERSITE=1 \
  PYTHONDONTWRITEBYTECODE=1 LD_LIBRARY_PATH=$new/stubs QEMU_CPU=max "$qemu" "$new/sysroot/usr/bin/python3.11" \
  pit_deploy/targets/executorch/emulated_pte_runner.py --probe 2>>"$log") ||
  fail "the emulated arm64 Python cannot import torch and the ExecuTorch runtime: $(tail -n1 "$log")"
[ "$probe" = "aarch64 $torch_version $executorch_version False" ] ||
  fail "the emulated arm64 Python reports '$probe', not 'aarch64 $torch_version $executorch_version False' (machine, torch, executorch, GPU)"

cat >"$new/setup.json" <<EOF
{
  "qemu": "bin/qemu-aarch64",
  "qemu_version": "$qemu_version",
  "sysroot": "sysroot",
  "python": "sysroot/usr/bin/python3.11",
  "site": "site",
  "onnxruntime": "$ort_version",
  "numpy": "$numpy_version",
  "onnxruntime_genai": "${genai}",
  "executorch_site": "site-executorch",
  "stubs": "stubs",
  "torch": "$torch_version",
  "executorch": "$executorch_version",
  "torchao": "$torchao_version"
}
EOF
rm -rf "$root.old"
if [ -e "$root" ]; then mv "$root" "$root.old"; fi
mv "$new" "$root" || fail "cannot move the set-up into $root"
rm -rf "$root.old"
echo "$want" >"$stamp"
