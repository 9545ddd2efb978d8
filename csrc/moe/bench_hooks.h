/// @file bench_hooks.h
/// Instrumentation of the dispatcher for tests_cpp/bench only. It exists in a build configured
/// with -DCPUMOE_BENCH_HOOKS=ON (off by default): a normal build compiles the macros below to
/// nothing, so the op carries none of it.
///
/// Internal to csrc/moe (the bench includes it by path). Four sites in the dispatcher:
/// - Phases: the pipeline announces each phase of a chunk where it runs the phases (one
///   CPUMOE_BENCH_PHASE in Pipeline::run) and, inside the activation loop, each step of a row
///   (CPUMOE_BENCH_STEP: activation, then the int8 family's requant). The bench installs a callback
///   that calls getppid(), which ../shared/tools/qemu-insn-count turns into a "mark" line, and
///   records the phase of every mark: the instructions between a mark and the next belong to the
///   phase of the first. Steps inside a parallel loop are reported only at one thread (counting
///   under qemu is one-thread anyway).
/// - Tasks: every task a parallel loop runs is counted for the thread that ran it, per phase, with
///   the work its body reports (CPUMOE_BENCH_TASK in parallel_for). A GEMM task reports its
///   multiply-adds over the kernel's padded register tiles (m, n, k rounded up to mr, nr, kr), so
///   the bench can show how the work splits over threads whatever the kernel.
#pragma once

#include <cstdint>

namespace cpumoe {
namespace bench_hooks {

enum Phase : int {
  route = 0,   ///< counting sort of the slots by expert
  quantize,    ///< per-token int8 quantization of x
  pack1,       ///< gather + pack of GEMM1's lhs
  gemm1,       ///< GEMM1 tasks (with their fp32 epilogue)
  activation,  ///< gated activation of a GEMM1 row with the rounding to the dtype (bf16 op: to bf16)
  requant,     ///< int8 requantization of an activation row
  pack2,       ///< gather + pack of GEMM2's lhs
  gemm2,       ///< GEMM2 tasks
  combine,     ///< weighted sum per token, stored in the input dtype
  num_phases
};
constexpr int kMaxThreads = 256;

const char* phase_name(int phase);

/// The dispatcher's side.
void enter_phase(int phase);  ///< calling thread, before the phase's parallel loop
void enter_step(int phase);   ///< inside a loop body: forwarded only while one thread runs
/// One task of the current phase ran on thread tid and did @p work multiply-adds (0: not a GEMM).
void count_task(int tid, int64_t work);

/// The bench's side.
using PhaseCallback = void (*)(int phase);
void set_phase_callback(PhaseCallback cb);  ///< nullptr: none (the default)
void set_single_thread(bool one);           ///< enter_step forwards only when true
void reset_tasks();
int64_t tasks(int phase, int tid);
int64_t work(int phase, int tid);

}  // namespace bench_hooks
}  // namespace cpumoe

#if defined(CPUMOE_BENCH_HOOKS)
#define CPUMOE_BENCH_PHASE(p) ::cpumoe::bench_hooks::enter_phase(p)
#define CPUMOE_BENCH_STEP(p) ::cpumoe::bench_hooks::enter_step(p)
#define CPUMOE_BENCH_TASK(tid, work) ::cpumoe::bench_hooks::count_task((tid), (work))
#else
#define CPUMOE_BENCH_PHASE(p) ((void)0)
#define CPUMOE_BENCH_STEP(p) ((void)0)
#define CPUMOE_BENCH_TASK(tid, work) ((void)0)
#endif
