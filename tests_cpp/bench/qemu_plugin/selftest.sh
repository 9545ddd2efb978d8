#!/usr/bin/env bash
# Self-test of the Arm instruction counter (insn_count.c through qemu-insn-count): builds the
# plugin from scratch and two aarch64 test programs, runs them under qemu-aarch64 -cpu max and
# checks the counts exactly. Last line: "N passed, M failed"; exit status 1 on any failure.
#
#   bash tests_cpp/bench/qemu_plugin/selftest.sh
#
# Needs: qemu-user, gcc, gcc-aarch64-linux-gnu (libc6-dev-arm64-cross for the C test).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export XDG_CACHE_HOME=$work/cache  # build the plugin afresh, not from a user's cache
counter=$here/qemu-insn-count
cc=aarch64-linux-gnu-gcc
march=-march=armv8.6-a+i8mm+bf16+dotprod
pass=0 fail=0

check() {  # name, expected, got
  if [ "$2" = "$3" ]; then pass=$((pass + 1)); echo "ok   $1"
  else fail=$((fail + 1)); echo "FAIL $1: expected [$2], got [$3]"; return 1; fi
}
finish() { echo "$pass passed, $fail failed"; [ "$fail" = 0 ]; exit $?; }

for tool in qemu-aarch64 gcc "$cc"; do
  command -v "$tool" >/dev/null || { check "tool $tool installed" yes no; finish; }
done

# 1. Static, no C library: every executed instruction is in test_counts.S, so the totals are
#    known exactly (derivation beside each mark there).
$cc $march -nostdlib -static -o "$work/test_counts" "$here/test_counts.S" 2>"$work/as.err"
check "assemble test_counts.S" 0 "$?" || cat "$work/as.err"
"$counter" -- "$work/test_counts" >/dev/null 2>"$work/counts.txt"
check "test_counts exit status" 0 "$?"
expect=(
  "mark 0 insns 2 smmla 0 bfmmla 0 sdot 0"                 # mov, svc
  "mark 1 insns 201 smmla 27 bfmmla 27 sdot 144"           # region 1: every SMMLA/BFMMLA/SDOT form
  "mark 2 insns 270 smmla 27 bfmmla 27 sdot 144"           # region 2: 68 look-alikes, none counted
  "mark 3 insns 7272 smmla 1027 bfmmla 1027 sdot 2144"     # region 3: 1000 x 7-instruction loop
  "mark 4 insns 7289 smmla 1027 bfmmla 1027 sdot 2147"     # region 4: 3 calls of a 2-insn function
  "exit 5 insns 7292 smmla 1027 bfmmla 1027 sdot 2147"     # mov, mov, svc exit_group
)
mapfile -t got <"$work/counts.txt"
check "test_counts line count" "${#expect[@]}" "${#got[@]}"
for i in "${!expect[@]}"; do
  check "test_counts: ${expect[$i]%% insns*}" "${expect[$i]}" "${got[$i]:-}"
done
plugin=$(ls "$XDG_CACHE_HOME"/cpumoe-qemu-plugin/insn_count-*.so 2>/dev/null)
check "plugin built into the cache" 1 "$(echo "$plugin" | grep -c .)"
stamp=$(stat -c %Y.%i "$plugin" 2>/dev/null)

# 2. Dynamically linked, marks through glibc's getppid(), as the benches do; the wrapper's
#    options and pass-through.
$cc $march -O2 -o "$work/test_libc" "$here/test_libc.c" 2>"$work/cc.err"
check "compile test_libc.c" 0 "$?" || cat "$work/cc.err"
"$counter" --out "$work/libc_out.txt" -- "$work/test_libc" 3 >/dev/null 2>"$work/libc.txt"
check "program exit status passed on" 3 "$?"
check "--out has the same lines as stderr" "$(cat "$work/libc.txt")" "$(cat "$work/libc_out.txt" 2>/dev/null)"
read -r d1 d2 < <(awk '$1 == "mark" { for (j = 3; j <= 9; j += 2) v[$2, j] = $(j + 1) }
  END { for (r = 1; r <= 2; r++) { s = ""
          for (j = 3; j <= 9; j += 2) s = s (j > 3 ? "," : "") v[r, j] - v[r - 1, j]
          printf "%s ", s } }' "$work/libc.txt")
check "glibc marks: region 1 smmla,bfmmla,sdot" "3,2,4" "${d1#*,}"
check "glibc marks: region 2 smmla,bfmmla,sdot" "3,2,4" "${d2#*,}"
check "glibc marks: region 2 - region 1 = 100 NOPs" 100 "$((${d2%%,*} - ${d1%%,*}))"
check "glibc marks: exit line counts 3 marks" 1 "$(grep -c '^exit 3 insns' "$work/libc.txt")"
check "cached plugin reused" "$stamp" "$(stat -c %Y.%i "$plugin" 2>/dev/null)"

finish
