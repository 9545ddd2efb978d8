/*
 * cpumoe's guest instruction counter: a qemu-user TCG plugin (plugin API version 1, QEMU 7.2 as in
 * Debian 12) that counts every AArch64 instruction the program executes and, among them, the
 * matrix / dot-product instructions that do the arithmetic of the int8 and bf16 kernels:
 *
 *   SMMLA  Vd.4S, Vn.16B, Vm.16B           int8 2x8 . 8x2 -> int32 2x2, 32 MACs
 *   BFMMLA Vd.4S, Vn.8H, Vm.8H             bf16 2x4 . 4x2 -> fp32 2x2, 16 MACs
 *   SDOT   Vd.{2S,4S}, Vn, Vm (or Vm.4B[i]) int8 4-way dot -> int32, 8 or 16 MACs
 *
 * Output (through qemu_plugin_outs, so it needs `-d plugin`, and `-D FILE` to leave stderr alone):
 *   mark N insns I smmla S bfmmla B sdot D   at the N-th getppid() system call (N from 0),
 *                                            running totals including that svc
 *   exit N insns I smmla S bfmmla B sdot D   at exit, N = number of marks
 * A program brackets a region with two getppid() calls and subtracts the two marks.
 *
 * Debian 12 packages no qemu-plugin.h (no qemu -dev package; `apt-cache search qemu | grep -i dev`
 * lists none, and qemu-user ships only the binaries), so the few entry points used below are
 * declared here, with the signatures of QEMU 7.2's include/qemu/qemu-plugin.h. qemu-aarch64 exports
 * them, and dlopen() binds them when the plugin loads.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* ---- declarations from the QEMU plugin API, version 1 ---- */
typedef uint64_t qemu_plugin_id_t;
typedef struct qemu_info_t qemu_info_t; /* only passed through, never read */
struct qemu_plugin_tb;
struct qemu_plugin_insn;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };

typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void *userdata);
typedef void (*qemu_plugin_vcpu_syscall_cb_t)(qemu_plugin_id_t id, unsigned int vcpu_index,
                                              int64_t num, uint64_t a1, uint64_t a2, uint64_t a3,
                                              uint64_t a4, uint64_t a5, uint64_t a6, uint64_t a7,
                                              uint64_t a8);

void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_syscall_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_syscall_cb_t cb);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op,
                                              void *ptr, uint64_t imm);
void qemu_plugin_register_vcpu_insn_exec_inline(struct qemu_plugin_insn *insn,
                                                enum qemu_plugin_op op, void *ptr, uint64_t imm);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
struct qemu_plugin_insn *qemu_plugin_tb_get_insn(const struct qemu_plugin_tb *tb, size_t idx);
const void *qemu_plugin_insn_data(const struct qemu_plugin_insn *insn);
size_t qemu_plugin_insn_size(const struct qemu_plugin_insn *insn);
void qemu_plugin_outs(const char *string);

#define EXPORT __attribute__((visibility("default")))
EXPORT int qemu_plugin_version = 1; /* QEMU refuses a plugin whose version it does not know */

/* ---- what is counted ---- */
enum { C_INSNS, C_SMMLA, C_BFMMLA, C_SDOT, N_COUNTERS };

/* The translated code adds into these directly (inline ops, no helper call per instruction).
 * The adds are plain load/add/store: concurrent guest threads would lose updates, hence one
 * thread for exact figures (README.md). */
static uint64_t counts[N_COUNTERS];
static uint64_t marks;

/* A class of instructions: the encoding bits that are not operands (mask) and their value.
 * Derived from the Arm ARM encoding diagrams; tests_cpp/bench/qemu_plugin/selftest.sh checks
 * each one against the assembler, with the neighbouring encodings (UDOT, USDOT, SUDOT, UMMLA,
 * USMMLA, BFDOT) that must not match. */
struct op_class {
    uint32_t mask, value;
    int counter;
};

/* Fixed fields of each encoding; Rd [4:0], Rn [9:5], Rm [20:16] (plus Q, and for the by-element
 * form L [21], M [20], H [11]) are free. */
static const struct op_class classes[] = {
    /* SMMLA (vector): 0 1 0 01110 10 0 Rm 1010 0 1 Rn Rd  (U=0; UMMLA has U=1, USMMLA opc 1011) */
    {0xffe0fc00u, 0x4e80a400u, C_SMMLA},
    /* BFMMLA: 0 1 1 01110 01 0 Rm 1110 1 1 Rn Rd */
    {0xffe0fc00u, 0x6e40ec00u, C_BFMMLA},
    /* SDOT (vector): 0 Q 0 01110 10 0 Rm 1001 0 1 Rn Rd  (U=0 at bit 29; Q free: .2S / .4S) */
    {0xbfe0fc00u, 0x0e809400u, C_SDOT},
    /* SDOT (by element): 0 Q 0 01111 10 L M Rm 1110 H 0 Rn Rd  (USDOT/SUDOT use opcode 1111) */
    {0xbfc0f400u, 0x0f80e000u, C_SDOT},
};

static int classify(uint32_t word) {
    for (size_t i = 0; i < sizeof classes / sizeof classes[0]; i++)
        if ((word & classes[i].mask) == classes[i].value) return classes[i].counter;
    return -1;
}

/* Called once per translation of a block; the inline ops it plants run at every execution.
 * One add of the block length at block entry counts the instructions (blocks end at branches
 * and system calls, so a mark sees every instruction before it, its svc included). */
static void on_tb_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
    (void)id;
    size_t n = qemu_plugin_tb_n_insns(tb);
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &counts[C_INSNS], n);
    for (size_t i = 0; i < n; i++) {
        struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);
        uint32_t word;
        if (qemu_plugin_insn_size(insn) != sizeof word) continue; /* A64 is fixed 4 bytes */
        memcpy(&word, qemu_plugin_insn_data(insn), sizeof word); /* guest and host little-endian */
        int c = classify(word);
        if (c >= 0)
            qemu_plugin_register_vcpu_insn_exec_inline(insn, QEMU_PLUGIN_INLINE_ADD_U64,
                                                       &counts[c], 1);
    }
}

static void emit(const char *what, uint64_t n) {
    char line[192];
    snprintf(line, sizeof line, "%s %llu insns %llu smmla %llu bfmmla %llu sdot %llu\n", what,
             (unsigned long long)n, (unsigned long long)counts[C_INSNS],
             (unsigned long long)counts[C_SMMLA], (unsigned long long)counts[C_BFMMLA],
             (unsigned long long)counts[C_SDOT]);
    qemu_plugin_outs(line);
}

/* getppid has no arguments and no side effects, so it is a cheap in-band marker any program
 * (C, C++, Python's os.getppid) can issue. 173 is its number in the AArch64 (generic) table. */
enum { NR_GETPPID_AARCH64 = 173 };

static void on_syscall(qemu_plugin_id_t id, unsigned int vcpu_index, int64_t num, uint64_t a1,
                       uint64_t a2, uint64_t a3, uint64_t a4, uint64_t a5, uint64_t a6,
                       uint64_t a7, uint64_t a8) {
    (void)id, (void)vcpu_index, (void)a1, (void)a2, (void)a3, (void)a4, (void)a5, (void)a6,
        (void)a7, (void)a8;
    if (num == NR_GETPPID_AARCH64) emit("mark", marks++);
}

static void on_exit(qemu_plugin_id_t id, void *userdata) {
    (void)id, (void)userdata;
    emit("exit", marks);
}

EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc,
                               char **argv) {
    (void)info, (void)argv;
    if (argc != 0) {
        qemu_plugin_outs("insn_count: takes no arguments\n");
        return -1;
    }
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_tb_translate);
    qemu_plugin_register_vcpu_syscall_cb(id, on_syscall);
    qemu_plugin_register_atexit_cb(id, on_exit, NULL);
    return 0;
}
