/// @file bench_hooks.h
/// Instrumentation of the dispatcher for tests_cpp/bench only. It exists in a build configured
/// with -DCPUMOE_BENCH_HOOKS=ON (off by default): a normal build compiles the macros below to
/// nothing, so the op carries none of it.
///
/// - Phases: the dispatcher announces each phase of a chunk (and, inside the activation loop, each
///   step of a row) through CPUMOE_BENCH_PHASE / CPUMOE_BENCH_STEP. The bench installs a callback
///   that calls getppid(), which ../shared/tools/qemu-insn-count turns into a "mark" line, and
///   records the phase of every mark: the instructions between a mark and the next belong to the
///   phase of the first. Steps inside a parallel loop are reported only at one thread (counting
///   under qemu is one-thread anyway).
/// - Tasks: every task a parallel loop runs is counted for the thread that ran it, per phase, with
///   the GEMM tasks' work in SMMLA-equivalents (row pairs x column pairs x 8-k slices), so the
///   bench can show how the work splits over threads.
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
void count_task(int tid);                ///< one task of the current phase ran on thread tid
void add_work(int tid, int64_t smmla);   ///< ... and did this many SMMLA-equivalents

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
#define CPUMOE_BENCH_PHASE(p) ::cpumoe::bench_hooks::enter_phase(::cpumoe::bench_hooks::p)
#define CPUMOE_BENCH_STEP(p) ::cpumoe::bench_hooks::enter_step(::cpumoe::bench_hooks::p)
#define CPUMOE_BENCH_TASK(tid) ::cpumoe::bench_hooks::count_task(tid)
#define CPUMOE_BENCH_WORK(tid, w) ::cpumoe::bench_hooks::add_work((tid), (w))
#else
#define CPUMOE_BENCH_PHASE(p) ((void)0)
#define CPUMOE_BENCH_STEP(p) ((void)0)
#define CPUMOE_BENCH_TASK(tid) ((void)0)
#define CPUMOE_BENCH_WORK(tid, w) ((void)0)
#endif
