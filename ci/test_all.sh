#!/usr/bin/env bash
# The full test suite (what README's test command and .ci/run call):
#   native     CMake build + GoogleTest via ctest on this machine
#   python     pip install . + pytest (torch backend, then numpy backend)
#   python-local  the same tests on a cmake-built extension, nothing installed (for development;
#              not in the default list)
#   cross      aarch64 cross build; ctest under qemu-aarch64 for -cpu max (I8MM path),
#              neoverse-n1 (no I8MM: must fall back, never SIGILL) and cortex-a57 (Armv8.0)
#   cross-python  the cross-built extension + pytest on an aarch64 CPython under qemu (numpy
#              backend), on max and neoverse-n1
# Usage: bash ci/test_all.sh [stage ...]   (default: all, in that order)
# Env: CPUMOE_BUILD_DIR (default ./build), CPUMOE_JOBS (default 2).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
BUILD=${CPUMOE_BUILD_DIR:-$root/build}
JOBS=${CPUMOE_JOBS:-2}
PY=${PYTHON:-python3}
stages=("$@")
((${#stages[@]})) || stages=(native python cross cross-python)

log() { printf '\n=== [test_all] %s\n' "$*"; }

bash ci/install_deps.sh

stage_native() {
  log "native: configure, build, ctest"
  cmake -S . -B "$BUILD/native" -G Ninja -DCMAKE_BUILD_TYPE=Release
  cmake --build "$BUILD/native" -j "$JOBS"
  ctest --test-dir "$BUILD/native" --output-on-failure -j "$JOBS"
}

stage_python() {
  log "python: pip install . and pytest"
  "$PY" -m pip install -q --no-build-isolation "$root"
  # Run from the repo root: python/cpumoe is not importable from here, so the installed package is
  # the one tested.
  "$PY" -m pytest tests_py -q
  log "python: pytest again on the numpy backend (torch never imported)"
  CPUMOE_TEST_BACKEND=numpy "$PY" -m pytest tests_py -q -p no:cacheprovider
}

# Stages the package from python/ plus a built _C*.so into $1/cpumoe (no pip install: several
# builds can be tested side by side).
stage_package() {
  local dest=$1 so=$2
  rm -rf "$dest" && mkdir -p "$dest/cpumoe"
  cp python/cpumoe/*.py python/cpumoe/*.pyi "$dest/cpumoe/"
  cp "$so" "$dest/cpumoe/"
}

stage_python_local() {
  log "python-local: cmake-built extension, pytest without installing (torch, then numpy)"
  cmake -S . -B "$BUILD/native-py" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCPUMOE_BUILD_TESTS=OFF \
    -DCPUMOE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v "$PY")" \
    -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)"
  cmake --build "$BUILD/native-py" -j "$JOBS"
  stage_package "$BUILD/native-py/pkg" "$(find "$BUILD/native-py/bindings" -maxdepth 1 -name '_C*.so' | head -n 1)"
  PYTHONPATH="$BUILD/native-py/pkg" "$PY" -m pytest tests_py -q -p no:cacheprovider
  CPUMOE_TEST_BACKEND=numpy PYTHONPATH="$BUILD/native-py/pkg" "$PY" -m pytest tests_py -q \
    -p no:cacheprovider
}

aarch64_python() {
  local out
  out=$(bash ci/setup_aarch64_python.sh)
  eval "$(grep -E '^(SYSROOT|SITE)=' <<<"$out")"
  mapfile -t PY_CMAKE_ARGS < <(bash ci/setup_aarch64_python.sh --print-cmake-args)
}

stage_cross() {
  log "cross: aarch64 build (with the Python module), ctest under qemu"
  aarch64_python
  cmake -S . -B "$BUILD/aarch64" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE="$root/cmake/toolchains/aarch64-linux-gnu.cmake" \
    -DCPUMOE_BUILD_PYTHON=ON "${PY_CMAKE_ARGS[@]}"
  cmake --build "$BUILD/aarch64" -j "$JOBS"
  for cpu in max neoverse-n1 cortex-a57; do
    log "cross: ctest with QEMU_CPU=$cpu"
    QEMU_CPU=$cpu ctest --test-dir "$BUILD/aarch64" --output-on-failure -j "$JOBS"
  done
}

stage_cross_python() {
  log "cross-python: pytest on aarch64 CPython under qemu"
  aarch64_python
  local pkg="$BUILD/aarch64/pkg"
  local so
  so=$(find "$BUILD/aarch64/bindings" -maxdepth 1 -name '_C*.so' | head -n 1)
  [ -n "$so" ] || { echo "cross-python: run the cross stage first (no _C*.so)" >&2; exit 1; }
  stage_package "$pkg" "$so"
  for cpu in max neoverse-n1; do
    log "cross-python: pytest with QEMU_CPU=$cpu"
    QEMU_CPU=$cpu CPUMOE_TEST_BACKEND=numpy PYTHONPATH="$pkg:$SITE" \
      qemu-aarch64 -L "$SYSROOT" "$SYSROOT/usr/bin/python3.11" -m pytest tests_py -q \
      -p no:cacheprovider
  done
}

for s in "${stages[@]}"; do
  case "$s" in
    native) stage_native ;;
    python) stage_python ;;
    python-local) stage_python_local ;;
    cross) stage_cross ;;
    cross-python) stage_cross_python ;;
    *) echo "unknown stage: $s (native, python, python-local, cross, cross-python)" >&2; exit 2 ;;
  esac
done
log "all requested stages passed: ${stages[*]}"
