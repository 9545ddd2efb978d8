#!/usr/bin/env bash
# Prints the Arm instruction-level performance table of the fused MoE op (issue 8): for each
# problem and each Arm int8 path, the guest instructions per call, the SMMLA (or BFMMLA / SDOT)
# executed per call, the SMMLA floor of the routing (PERF.md) and the useful share
# (floor / instructions), counted exactly by tests_cpp/bench/qemu_plugin/qemu-insn-count under qemu-aarch64,
# one thread. Then the share of each phase of the call (bench-hooks build, see
# csrc/moe/bench_hooks.h).
#
#   tests_cpp/bench/arm_perf_table.sh [--build DIR] [--src DIR] [--paths "neon_i8mm ..."]
#                                     [--problems "qwen3:1 gptoss:64 ..."] [--iters N]
#                                     [--cpu max] [--no-phases] [--raw DIR]
#                                     [--formats "int8 int4 int4:32 mxfp4"]
#
# --build  an aarch64 build dir that has tests_cpp/cpumoe_moe_bench (configured with
#          -DCPUMOE_BENCH_HOOKS=ON for the phase table). Without it the script cross-builds
#          --src (default: this checkout) into /tmp/cpumoe-arm-perf-build with -j2.
# --paths  default: neon_i8mm neon_bf16 neon_dotprod portable (each passed as --isa, a cap)
# --problems  default: qwen3:1 qwen3:16 qwen3:128 gptoss:1 gptoss:64
#          qwen3  = Qwen3-30B-A3B layer: H=2048 I=768  E=128 k=8 silu,      bf16 activations
#          gptoss = gpt-oss-20b layer:   H=2880 I=2880 E=32  k=4 swigluoai, bf16 activations
# --raw    keep each run's bench output and counter marks in DIR
# --formats  weight formats (default int8): int4[:G] (W4A8, group G, default 128) and mxfp4 run
#          the same paths on 4-bit weights, bf16 the BF16 op, fp8[:G] the BF16 op on FP8 weights
#          (G x G blocks, default 128); their rows are labelled path/format (gptoss: G must
#          divide 2880, i.e. int4:32 or int4:64); a path is a cap: each format takes its best
#          kernel at or below it
# Needs: g++-aarch64-linux-gnu, qemu-user, gcc, python3, cmake, ninja.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=$(cd "$here/../.." && pwd)
build="" iters=2 cpu=max phases=1 raw="" formats="int8"
paths="neon_i8mm neon_bf16 neon_dotprod portable"
problems="qwen3:1 qwen3:16 qwen3:128 gptoss:1 gptoss:64"
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --src) src=$(cd "$2" && pwd); shift 2 ;;
    --paths) paths=$2; shift 2 ;;
    --problems) problems=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --cpu) cpu=$2; shift 2 ;;
    --no-phases) phases=0; shift ;;
    --raw) raw=$2; shift 2 ;;
    --formats) formats=$2; shift 2 ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

. "$here/qemu_counter.sh" "$src"  # sets counter

if [ -z "$build" ]; then
  build=/tmp/cpumoe-arm-perf-build
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCPUMOE_BENCH_HOOKS=ON \
    -DCMAKE_TOOLCHAIN_FILE="$src/cmake/toolchains/aarch64-linux-gnu.cmake" >/dev/null
  cmake --build "$build" -j2 --target cpumoe_moe_bench >/dev/null
fi
bench=$build/tests_cpp/cpumoe_moe_bench
[ -x "$bench" ] || { echo "no $bench" >&2; exit 1; }
hooks=$(grep -c '^CPUMOE_BENCH_HOOKS:BOOL=ON' "$build/CMakeCache.txt" || true)
[ "$hooks" = 1 ] || phases=0

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ -z "$raw" ] || mkdir -p "$raw"

args_of() {
  case "$1" in
    qwen3) echo "--H 2048 --I 768 --E 128 --k 8 --act silu --dtype bf16" ;;
    gptoss) echo "--H 2880 --I 2880 --E 32 --k 4 --act swigluoai --dtype bf16" ;;
    *) echo "unknown problem $1" >&2; exit 2 ;;
  esac
}

for prob in $problems; do
  name=${prob%%:*} T=${prob##*:}
  for fmt in $formats; do
  for path in $paths; do
    fname=${fmt%%:*} group=128 label=$path
    [ "$fname" = "$fmt" ] || group=${fmt##*:}
    [ "$fname" = int8 ] || label=$path/$fmt
    tag=${name}_T${T}_${path}_${fmt/:/g}
    # shellcheck disable=SC2046
    OMP_NUM_THREADS=1 "$counter" --cpu "$cpu" -- "$bench" $(args_of "$name") --T "$T" \
      --iters "$iters" --isa "$path" --threads 1 --phases "$phases" --format "$fname" \
      --group "$group" \
      >"$work/$tag.out" 2>"$work/$tag.marks" || { echo "run $tag failed" >&2; cat "$work/$tag.marks" >&2; exit 1; }
    echo "$name $T $label $work/$tag.out $work/$tag.marks" >>"$work/runs"
    [ -z "$raw" ] || cp "$work/$tag.out" "$work/$tag.marks" "$raw/"
  done
  done
done

python3 - "$work/runs" "$iters" "$phases" "$cpu" <<'EOF'
import sys
runs, iters, phases, cpu = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
rows, phase_rows, names = [], [], {}
for line in open(runs):
    prob, T, path, out, marks = line.split()
    info, seq = {}, []
    for l in open(out):
        f = l.split()
        if f and f[0] == "kernel":
            info = dict(zip(f[0::2], f[1::2]))
        elif f and f[0] == "phases":
            names = {int(a.split(":")[0]): a.split(":")[1] for a in f[1:]}
        elif f and f[0] == "phase_seq":
            seq = [int(x) for x in f[1:]]
    m = []  # (insns, smmla, bfmmla, sdot) of every mark
    for l in open(marks):
        f = l.split()
        if f and f[0] == "mark":
            m.append(tuple(int(f[i]) for i in (3, 5, 7, 9)))
    a, b = m[0], m[1]
    insns = (b[0] - a[0]) / iters
    mm = [(b[i] - a[i]) / iters for i in (1, 2, 3)]
    floor = int(info["smmla_floor/call"])
    rows.append((prob, T, path, info["kernel"], insns, mm, floor, info.get("active_experts", "?"),
                 info.get("max_rows", "?")))
    if phases and seq:
        pm = m[1:]  # end of measured calls, the phase marks, the final mark
        assert len(pm) == len(seq) + 2, (out, len(pm), len(seq))
        per = {}
        for j, p in enumerate(seq):
            per[p] = per.get(p, 0) + pm[j + 2][0] - pm[j + 1][0]
        tot = pm[-1][0] - pm[0][0]
        phase_rows.append((prob, T, path, tot / iters, {p: v / tot for p, v in per.items()}))

print(f"Arm int8 MoE, instructions per call under qemu-aarch64 -cpu {cpu}, 1 thread, bf16 activations")
print("(qwen3: H=2048 I=768 E=128 k=8 silu; gptoss: H=2880 I=2880 E=32 k=4 swigluoai)\n")
print("| problem | T | path | active experts | max m_e | insns/call | SMMLA/call | BFMMLA/call | SDOT/call | min SMMLA | useful share |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for prob, T, path, kern, insns, mm, floor, act, mx in rows:
    print(f"| {prob} | {T} | {path} | {act} | {mx} | {insns:,.0f} | {mm[0]:,.0f} | {mm[1]:,.0f} | {mm[2]:,.0f} | {floor:,} | {floor / insns:.3f} |")
if phase_rows:
    order = sorted(names)
    print("\nShare of each phase in the call's instructions (phase-marked calls; the int8 op's activation step includes the rounding to the dtype, fused, then requant):\n")
    print("| problem | T | path | insns/call | " + " | ".join(names[p] for p in order) + " |")
    print("|---|---|---|---|" + "---|" * len(order))
    for prob, T, path, tot, sh in phase_rows:
        print(f"| {prob} | {T} | {path} | {tot:,.0f} | " +
              " | ".join(f"{100 * sh.get(p, 0):.1f}%" for p in order) + " |")
EOF
