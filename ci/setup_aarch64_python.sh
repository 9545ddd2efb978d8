#!/usr/bin/env bash
# setup_aarch64_python.sh — build (once) and cache an aarch64 CPython 3.11 that runs under
# qemu-user on an x86-64 host, plus the aarch64 wheels the tests need (numpy, ml_dtypes, pytest).
#
# Usage:
#   bash ci/setup_aarch64_python.sh                     # ensure cache; last stdout lines: SYSROOT=..., SITE=...
#   bash ci/setup_aarch64_python.sh --print-cmake-args  # ensure cache; print CMake args, one per line
#   options: --verify (re-run the import check on a cached setup), --force (rebuild everything)
#
#   eval "$(bash ci/setup_aarch64_python.sh | grep -E '^(SYSROOT|SITE)=')"
#   args="$(bash ci/setup_aarch64_python.sh --print-cmake-args)"; mapfile -t PY_CMAKE_ARGS <<<"$args"
#   PYTHONPATH="$SITE:build" qemu-aarch64 -cpu max -L "$SYSROOT" "$SYSROOT/usr/bin/python3.11" -m pytest
#
# Environment: CPUMOE_AARCH64_CACHE (default ~/.cache/cpumoe-aarch64).
# Only stdout carries results; all progress goes to stderr.
# Host side effects: `dpkg --add-architecture arm64` and `apt-get update` (only when the arm64
# lists are missing), `apt-get install qemu-user` if qemu-aarch64 is missing. Arm64 packages are
# only downloaded and unpacked with `dpkg -x` into the cache, never installed into the host.
set -euo pipefail

# Keep the real stdout on fd 3 for results; everything else (apt, pip, dpkg) goes to stderr.
exec 3>&1 1>&2

log() { printf '[setup_aarch64_python] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

MODE=env FORCE=0 VERIFY=0
for arg in "$@"; do
  case "$arg" in
    --print-cmake-args) MODE=cmake ;;
    --verify) VERIFY=1 ;;
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//' >&3; exit 0 ;;
    *) die "unknown argument: $arg (see --help)" ;;
  esac
done

# CI may run without a login environment; never prompt.
export DEBIAN_FRONTEND=noninteractive
: "${HOME:=$(getent passwd "$(id -u)" | cut -d: -f6)}"
CACHE="${CPUMOE_AARCH64_CACHE:-$HOME/.cache/cpumoe-aarch64}"
mkdir -p "$CACHE"
CACHE="$(cd "$CACHE" && pwd -P)"   # absolute: qemu -L and CMake need absolute paths
SYSROOT="$CACHE/sysroot"
SITE="$CACHE/site"

# ---------------------------------------------------------------- what goes into the cache
# Debian bookworm arm64 runtime closure of python3.11 (from /work/shared/CROSS.md), plus the
# headers for building extensions. Arch:all packages are downloaded without ":arm64".
DEBS_ARM64=(
  libc6 libgcc-s1 gcc-12-base libstdc++6 libgomp1 zlib1g libexpat1 libffi8 libssl3 libbz2-1.0
  liblzma5 libsqlite3-0 libuuid1 libncursesw6 libtinfo6 libreadline8 libcrypt1 libdb5.3 libgdbm6
  libgdbm-compat4 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0
  libkeyutils1 libcom-err2 libpython3.11-minimal libpython3.11-stdlib python3.11-minimal python3.11
  libpython3.11-dev
)
DEBS_ALL=(readline-common libtirpc-common media-types)

# Pinned so every CI run gets the same bits; bump deliberately (the stamp hash then rebuilds site/).
WHEELS=(
  numpy==2.4.6 ml_dtypes==0.6.0
  pytest==9.2.0 iniconfig==2.3.1 packaging==26.4 pluggy==1.7.0 pygments==2.21.0
)
# Bookworm has glibc 2.36: list every manylinux_2_X tag it satisfies, because pip does not
# expand an explicit --platform to older glibc tags (a wheel tagged only manylinux_2_27 would
# otherwise be missed).
PLATFORMS=(manylinux2014_aarch64)
for minor in $(seq 36 -1 17); do PLATFORMS+=("manylinux_2_${minor}_aarch64"); done

PY_VER=3.11
SOABI=cpython-311-aarch64-linux-gnu
LAYOUT=1   # bump when the way the cache is laid out changes

# The stamps are hashes of the recipe: any change to the lists forces a rebuild of that part.
hash_of() { printf '%s\n' "$@" | sha256sum | cut -c1-16; }
SYSROOT_KEY="$(hash_of "layout=$LAYOUT" "${DEBS_ARM64[@]}" -- "${DEBS_ALL[@]}")"
SITE_KEY="$(hash_of "layout=$LAYOUT" "${WHEELS[@]}" -- "${PLATFORMS[@]}")"
stamp_ok() { [[ $FORCE == 0 && -f "$1/.cpumoe-stamp" && "$(cat "$1/.cpumoe-stamp")" == "$2" ]]; }

# ---------------------------------------------------------------- helpers
# Root for host apt operations: directly in CI (root), via passwordless sudo elsewhere.
as_root() {
  if [[ $(id -u) == 0 ]]; then "$@"
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo -n "$@"
  else die "need root for: $*"
  fi
}

# apt-get update may return non-zero because of unrelated third-party sources; the real test
# is whether the arm64 package lists are usable afterwards.
apt_update() {
  log "apt-get update"
  as_root apt-get update -qq </dev/null || log "warning: apt-get update reported errors, continuing"
}
arm64_lists_present() { apt-cache show --no-all-versions libc6:arm64 python3.11:arm64 >/dev/null 2>&1; }

# The host Python: used for pip, compileall and as CMake's Python_EXECUTABLE. Resolve pyenv-style
# shims to the real binary so CMake caches a stable path.
HOST_PY="$(command -v python3 || true)"
[[ -n $HOST_PY ]] || die "python3 not found on the host"
HOST_PY="$("$HOST_PY" -c 'import sys; print(sys.executable)')"
host_py_is_311() { "$HOST_PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; }

# Fresh work dirs live inside the cache: same filesystem (atomic mv) and writable for apt.
new_workdir() { mktemp -d "$CACHE/.work.$1.XXXXXX"; }
# Safe to remove them all: only the lock holder creates them.
cleanup() { rm -rf "$CACHE"/.work.* 2>/dev/null || true; }

# Replace $1 with $2 atomically enough: readers never see a half-filled directory.
swap_in() {
  local dst=$1 new=$2
  if [[ -e $dst ]]; then mv "$dst" "$dst.old.$$"; fi
  mv "$new" "$dst"
  rm -rf "$dst.old.$$"
}

# ---------------------------------------------------------------- sysroot
build_sysroot() {
  log "building sysroot (Debian bookworm arm64, python$PY_VER) in $SYSROOT"
  { command -v dpkg && command -v apt-get; } >/dev/null || die "needs a Debian/Ubuntu host (dpkg, apt-get)"

  local need_update=0
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    log "dpkg --add-architecture arm64"
    as_root dpkg --add-architecture arm64
    need_update=1
  fi
  if [[ $need_update == 1 ]] || ! arm64_lists_present; then apt_update; fi
  arm64_lists_present || die "no arm64 package lists after apt-get update (is an arm64 Debian mirror configured?)"

  local work; work="$(new_workdir sysroot)"
  mkdir -p "$work/debs" "$work/root"
  local pkgs=("${DEBS_ARM64[@]/%/:arm64}" "${DEBS_ALL[@]}")
  # apt-get download writes into the current directory, so cd into the (writable) work dir.
  # Sandbox::User=root: as root, apt would otherwise drop to _apt, which cannot write there.
  # One retry after apt-get update covers stale lists (old versions already gone from the mirror).
  if ! (cd "$work/debs" && apt-get download -qq -o APT::Sandbox::User=root "${pkgs[@]}" </dev/null); then
    log "apt-get download failed; refreshing lists and retrying once"
    apt_update
    rm -f "$work/debs"/*.deb
    (cd "$work/debs" && apt-get download -qq -o APT::Sandbox::User=root "${pkgs[@]}" </dev/null) \
      || die "apt-get download failed"
  fi

  # dpkg -x only unpacks (no maintainer scripts, no host dpkg database): safe for a foreign arch.
  local deb
  for deb in "$work/debs"/*.deb; do
    dpkg -x "$deb" "$work/root"
    dpkg-deb -f "$deb" Package Version Architecture | paste -sd' ' >>"$work/root/.cpumoe-manifest"
  done

  # Absolute symlinks would resolve against the host's / rather than the sysroot; make them relative.
  local link target
  while IFS= read -r -d '' link; do
    target="$(readlink "$link")"
    [[ $target == /* ]] || continue
    ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$work/root$target")" "$link"
  done < <(find "$work/root" -type l -print0)

  [[ -x $work/root/usr/bin/python$PY_VER ]] || die "python$PY_VER missing from the extracted sysroot"
  [[ -f $work/root/usr/include/python$PY_VER/Python.h ]] || die "Python.h missing (libpython$PY_VER-dev)"

  # Debian ships no .pyc (its postinst compiles them); doing it here with the host's 3.11 (same
  # bytecode magic) saves each emulated start-up from compiling the stdlib. Some intentionally
  # broken test-data files fail to compile, hence no hard error.
  if host_py_is_311; then
    log "byte-compiling the sysroot stdlib with host $HOST_PY"
    "$HOST_PY" -m compileall -q -j0 "$work/root/usr/lib/python$PY_VER" >/dev/null 2>&1 \
      || log "note: some stdlib files did not byte-compile (harmless)"
  fi

  swap_in "$SYSROOT" "$work/root"
  rm -rf "$work"
}

# ---------------------------------------------------------------- site (wheels)
build_site() {
  log "building site-packages (${WHEELS[*]}) in $SITE"
  local work; work="$(new_workdir site)"
  mkdir -p "$work/wheels" "$work/site"
  local platform_args=() p
  for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
  # --platform accepts py3-none-any wheels as well, so pure-Python packages need nothing extra.
  "$HOST_PY" -m pip download -q --disable-pip-version-check --no-input --no-deps \
    --only-binary=:all: "${platform_args[@]}" --python-version "$PY_VER" --implementation cp \
    -d "$work/wheels" "${WHEELS[@]}" </dev/null \
    || die "pip download of aarch64 wheels failed"

  local whl d
  for whl in "$work/wheels"/*.whl; do
    "$HOST_PY" -m zipfile -e "$whl" "$work/site"   # no dependency on unzip
    basename "$whl" >>"$work/site/.cpumoe-manifest"
  done
  # Wheels may carry files under NAME.data/{purelib,platlib}; those belong at the top level.
  for d in "$work/site"/*.data; do
    [[ -d $d ]] || continue
    for p in purelib platlib; do
      if [[ -d $d/$p ]]; then cp -a "$d/$p/." "$work/site/"; fi
    done
    rm -rf "$d"
  done

  # Compile with the host's interpreter: far faster than under emulation, same 3.11 magic number.
  if host_py_is_311; then
    log "byte-compiling site with host $HOST_PY"
    "$HOST_PY" -m compileall -q -j0 "$work/site" >/dev/null || log "note: some files did not byte-compile"
  else
    log "host python is not 3.11: skipping compileall (the guest compiles on first import)"
  fi

  swap_in "$SITE" "$work/site"
  rm -rf "$work"
}

# ---------------------------------------------------------------- verify
run_guest_python() {
  # -cpu max: I8MM/BF16/SVE like the kernels expect; -L makes the sysroot the guest's /.
  env -u PYTHONHOME PYTHONNOUSERSITE=1 PYTHONPATH="$SITE" \
    qemu-aarch64 -cpu max -L "$SYSROOT" "$SYSROOT/usr/bin/python$PY_VER" "$@" </dev/null
}
verify() {
  log "verifying: import numpy, ml_dtypes, pytest under qemu-aarch64"
  local out
  out="$(run_guest_python -c 'import platform, numpy, ml_dtypes, pytest; print(platform.machine(), platform.python_version(), "numpy", numpy.__version__, "ml_dtypes", ml_dtypes.__version__, "pytest", pytest.__version__)')" \
    || die "the aarch64 python failed to import numpy/ml_dtypes/pytest"
  log "ok: $out"
}

# ---------------------------------------------------------------- pybind11 CMake args
# pybind11's CMake dir: the host's pybind11 if installed (same one the project's build uses),
# else a pinned wheel unpacked into the cache (does not touch the host's site-packages).
pybind11_cmakedir() {
  local dir
  if dir="$("$HOST_PY" -m pybind11 --cmakedir 2>/dev/null)" && [[ -d $dir ]]; then
    printf '%s\n' "$dir"; return
  fi
  local ver=3.1.0 dst="$CACHE/host-pybind11"
  if [[ ! -f $dst/.cpumoe-stamp || "$(cat "$dst/.cpumoe-stamp")" != "$ver" ]]; then
    log "host has no pybind11: unpacking pybind11==$ver into $dst"
    local work; work="$(new_workdir pybind11)"
    "$HOST_PY" -m pip download -q --disable-pip-version-check --no-input --no-deps \
      --only-binary=:all: -d "$work" "pybind11==$ver" </dev/null || die "pip download pybind11 failed"
    mkdir -p "$work/x"
    "$HOST_PY" -m zipfile -e "$work"/pybind11-*.whl "$work/x"
    echo "$ver" >"$work/x/.cpumoe-stamp"
    swap_in "$dst" "$work/x"
    rm -rf "$work"
  fi
  printf '%s\n' "$dst/pybind11/share/cmake/pybind11"
}

print_cmake_args() {
  host_py_is_311 || log "warning: host python $HOST_PY is not $PY_VER; FindPython may reject the $PY_VER headers"
  local inc="$SYSROOT/usr/include"
  # Both spellings: new-mode FindPython reads Python_*; classic FindPythonLibsNew reads PYTHON_*
  # (and only keeps them with PYBIND11_PYTHONLIBS_OVERWRITE=OFF, otherwise it asks the host
  # interpreter and gets x86-64 answers). Debian's pyconfig.h includes
  # <aarch64-linux-gnu/python3.11/pyconfig.h>, hence -isystem on usr/include (FindPython
  # rejects a list in Python_INCLUDE_DIR). The sysroot has no libc headers, so this cannot
  # shadow the cross compiler's own.
  printf '%s\n' \
    "-DPython_EXECUTABLE=$HOST_PY" \
    "-DPython_INCLUDE_DIR=$inc/python$PY_VER" \
    "-DPython_SOABI=$SOABI" \
    "-DPYTHON_EXECUTABLE=$HOST_PY" \
    "-DPYTHON_INCLUDE_DIR=$inc/python$PY_VER" \
    "-DPYBIND11_PYTHONLIBS_OVERWRITE=OFF" \
    "-DPYTHON_MODULE_EXTENSION=.$SOABI.so" \
    "-DCMAKE_CXX_FLAGS=-isystem $inc" \
    "-Dpybind11_DIR=$(pybind11_cmakedir)" >&3
}

# ---------------------------------------------------------------- main
# Serialise concurrent runs (parallel CI jobs sharing one cache).
if command -v flock >/dev/null; then
  exec 9>"$CACHE/.lock"
  flock -w 900 9 || die "timed out waiting for $CACHE/.lock"
fi
trap cleanup EXIT
rm -rf "$CACHE"/.work.* 2>/dev/null || true   # leftovers of an interrupted run (we hold the lock)

command -v qemu-aarch64 >/dev/null || {
  log "qemu-aarch64 missing: installing qemu-user"
  as_root apt-get install -y -qq --no-install-recommends qemu-user </dev/null \
    || { apt_update; as_root apt-get install -y -qq --no-install-recommends qemu-user </dev/null; } \
    || die "could not install qemu-user"
}

built=0
if stamp_ok "$SYSROOT" "$SYSROOT_KEY"; then log "sysroot cached ($SYSROOT_KEY)"; else build_sysroot; built=1; fi
if stamp_ok "$SITE" "$SITE_KEY"; then log "site cached ($SITE_KEY)"; else build_site; built=1; fi

if [[ $built == 1 || $VERIFY == 1 ]]; then
  # Stamps are written only after the import check passes, so a broken build is retried next run.
  rm -f "$SYSROOT/.cpumoe-stamp" "$SITE/.cpumoe-stamp"
  verify
  echo "$SYSROOT_KEY" >"$SYSROOT/.cpumoe-stamp"
  echo "$SITE_KEY" >"$SITE/.cpumoe-stamp"
fi

if [[ $MODE == cmake ]]; then
  print_cmake_args
else
  # %q keeps the lines eval-safe even for a cache path with spaces.
  printf 'SYSROOT=%q\nSITE=%q\n' "$SYSROOT" "$SITE" >&3
fi
