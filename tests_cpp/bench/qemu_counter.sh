# Sourced by the Arm counting scripts (arm_perf_table.sh, arm_vllm_w4a8_count.sh): sets `counter`
# to ../shared's qemu-insn-count beside the checkout $1 (or /work/shared's), else exits.
counter=""
for c in "$1/../shared/tools/qemu-insn-count/qemu-insn-count" \
         /work/shared/tools/qemu-insn-count/qemu-insn-count; do
  [ -x "$c" ] && { counter=$c; break; }
done
[ -n "$counter" ] || { echo "qemu-insn-count not found (../shared/tools)" >&2; exit 1; }
