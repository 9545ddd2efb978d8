# Sourced by the Arm counting scripts (arm_perf_table.sh, arm_vllm_w4a8_count.sh): sets `counter`
# to the repository's own qemu-user instruction counter, qemu_plugin/qemu-insn-count beside this
# file (README.md there), else exits. The counter of this checkout is used even when the script
# measures another source tree (--src), so the figures of both come from one counter.
counter=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/qemu_plugin/qemu-insn-count
[ -x "$counter" ] || { echo "no counter at $counter" >&2; exit 1; }
for tool in qemu-aarch64 gcc; do
  command -v "$tool" >/dev/null || { echo "the Arm counter needs $tool (apt-get install qemu-user gcc)" >&2; exit 1; }
done
