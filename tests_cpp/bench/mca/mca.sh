#!/usr/bin/env bash
# Models the SMMLA kernel's inner loops with llvm-mca (results: docs/kernels.md).
#
#   [MCA_OUT=<dir>] tests_cpp/bench/mca/mca.sh [OBJECT] [--extract-only]
#
# OBJECT: the compiled qgemm_qs8p8x8_qs8cp8x8_8x8_neon_i8mm.cpp.o of an aarch64 build (default:
# found under /tmp/cpumoe-arm-perf-build, the build of tests_cpp/bench/arm_perf_table.sh). The
# script disassembles it (aarch64-linux-gnu-objdump -d), takes every steady-state loop (the body
# between a backward b.ne and its target that holds 8 or more unrolled slices of SMMLA; per tile
# the most unrolled one, i.e. the 32-slice loop), names it by its tile (NPxNB from
# the accumulators and the B loads per slice), writes it as loop_<tile>.s into MCA_OUT (default
# /tmp/cpumoe-mca; generated, never committed) and runs llvm-mca-19 -mtriple=aarch64 -mcpu=<cpu> -mattr=+i8mm,+bf16 -iterations=500 on it for
# neoverse-v1, -v2 and -n2. Prints cycles per 8-k slice against the SMMLA peak (4 per cycle on
# V1/V2, 2 on N2).
set -euo pipefail
here=${MCA_OUT:-/tmp/cpumoe-mca}
mkdir -p "$here"
obj=${1:-$(find /tmp/cpumoe-arm-perf-build -name 'qgemm_qs8p8x8_qs8cp8x8_8x8_neon_i8mm.cpp.o' | head -1)}
[ -f "$obj" ] || { echo "no object file (build the aarch64 tree first)" >&2; exit 1; }
aarch64-linux-gnu-objdump -d --no-show-raw-insn "$obj" > "$here/.objdump.txt"
python3 - "$here" <<'PY'
import re, sys, os, glob
here = sys.argv[1]
lines = open(os.path.join(here, '.objdump.txt')).read().splitlines()
ins = []  # (addr, text)
for l in lines:
    m = re.match(r'^\s+([0-9a-f]+):\s+(.*)$', l)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).split('//')[0].strip()))
index = {a: i for i, (a, _) in enumerate(ins)}
seen = {}  # tile -> (slices, body)
for i, (a, t) in enumerate(ins):
    m = re.match(r'b\.ne\s+([0-9a-f]+)', t)
    if not m:
        continue
    tgt = int(m.group(1), 16)
    if tgt >= a or tgt not in index:
        continue
    body = [x for _, x in ins[index[tgt]:i + 1]]
    if any(re.match(r'(b|b\.\w+|cbn?z|tbn?z|bl|br|ret)\s', x) for x in body[:-1]):
        continue  # an outer loop (the loop over tiles), not a k-loop
    mm = [x for x in body if x.startswith('smmla')]
    if len(mm) < 32:
        continue  # the single-slice remainder loops
    acc = {re.match(r'smmla\s+(v\d+)', x).group(1) for x in mm}
    slices = len(mm) // len(acc)
    if slices < 8 or len(mm) % len(acc):
        continue
    nb = sum(bool(re.match(r'ld1\s+\{v4\.16b-v7\.16b\}', x)) for x in body) // slices
    np_ = len(acc) // (4 * nb)
    name = f'{np_}x{nb}'
    if name in seen and seen[name][0] >= slices:
        continue  # keep the most unrolled loop of each tile
    seen[name] = (slices, body)
for f in glob.glob(os.path.join(here, 'loop_*.s')):
    os.remove(f)
for name, (slices, body) in seen.items():
    per = sum(x.startswith('smmla') for x in body) // slices
    text = [x.replace('\t', ' ') for x in body[:-1]] + ['b.ne loop']
    with open(os.path.join(here, f'loop_{name}.s'), 'w') as f:
        f.write(f'# tile {name}: {per} SMMLA per 8-k slice, {slices} slices per iteration '
                f'(extracted by mca.sh from objdump -d of the kernel object)\nloop:\n')
        f.write('\n'.join('  ' + x for x in text) + '\n')
print(' '.join(sorted(seen)))
PY
rm -f "$here/.objdump.txt"
[ "${2:-}" = "--extract-only" ] && exit 0
printf '%-6s %-12s %8s %10s %10s %8s\n' tile cpu smmla/k cyc/k peak/k "%peak"
for s in "$here"/loop_*.s; do
  tile=$(basename "$s" .s); tile=${tile#loop_}
  mm=$(grep -c smmla "$s")
  sl=$(sed -n 's/.* \([0-9]*\) slices per iteration.*/\1/p' "$s")
  for cpu in neoverse-v1 neoverse-v2 neoverse-n2; do
    cyc=$(llvm-mca-19 -mtriple=aarch64 -mcpu=$cpu -mattr=+i8mm,+bf16 -iterations=500 "$s" |
          awk '/Total Cycles:/{print $3}')
    rate=4; [ "$cpu" = neoverse-n2 ] && rate=2
    python3 -c "c=$cyc/500/$sl; mm=$mm/$sl; p=mm/$rate; print(f'%-6s %-12s %8d %10.2f %10.2f %7.1f%%' % ('$tile', '$cpu', mm, c, p, 100*p/c))"
  done
done
