# Sourced by the prepared GPU scripts: the checkout on PYTHONPATH (no install: the machine has no
# package registry), the carried pure-Python packages, offline Hugging Face libraries.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d build/gpu-common/site ] && ! python -c "import gguf" 2>/dev/null; then
    export PYTHONPATH="$PYTHONPATH:$PWD/build/gpu-common/site"   # after the machine's own packages
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
smoke() { [ -n "${PIT_GPU_SMOKE:-}" ] && [ "${PIT_GPU_SMOKE}" != 0 ]; }
