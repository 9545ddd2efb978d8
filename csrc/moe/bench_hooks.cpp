// The bench-only instrumentation of the dispatcher (bench_hooks.h). Compiled into
// cpumoe_moe only when CMake's CPUMOE_BENCH_HOOKS is ON.
#include "bench_hooks.h"

#include <atomic>

namespace cpumoe {
namespace bench_hooks {
namespace {

std::atomic<PhaseCallback> g_callback{nullptr};
std::atomic<bool> g_single{false};
std::atomic<int> g_phase{0};
// [phase][thread]; relaxed atomics: each thread adds to its own cells, the bench reads after.
std::atomic<int64_t> g_tasks[num_phases][kMaxThreads];
std::atomic<int64_t> g_work[num_phases][kMaxThreads];

bool valid(int phase, int tid) {
  return phase >= 0 && phase < num_phases && tid >= 0 && tid < kMaxThreads;
}

}  // namespace

const char* phase_name(int phase) {
  static const char* const names[num_phases] = {"route",   "quantize", "pack1", "gemm1",
                                                "activation", "requant", "pack2",
                                                "gemm2",   "combine"};
  return phase >= 0 && phase < num_phases ? names[phase] : "?";
}

void enter_phase(int phase) {
  g_phase.store(phase, std::memory_order_relaxed);
  if (PhaseCallback cb = g_callback.load(std::memory_order_relaxed)) cb(phase);
}

void enter_step(int phase) {
  if (!g_single.load(std::memory_order_relaxed)) return;
  if (PhaseCallback cb = g_callback.load(std::memory_order_relaxed)) cb(phase);
}

void count_task(int tid, int64_t work) {
  const int p = g_phase.load(std::memory_order_relaxed);
  if (!valid(p, tid)) return;
  g_tasks[p][tid].fetch_add(1, std::memory_order_relaxed);
  if (work != 0) g_work[p][tid].fetch_add(work, std::memory_order_relaxed);
}

void set_phase_callback(PhaseCallback cb) { g_callback.store(cb); }
void set_single_thread(bool one) { g_single.store(one); }

void reset_tasks() {
  for (int p = 0; p < num_phases; ++p)
    for (int t = 0; t < kMaxThreads; ++t) {
      g_tasks[p][t].store(0);
      g_work[p][t].store(0);
    }
}

int64_t tasks(int phase, int tid) { return valid(phase, tid) ? g_tasks[phase][tid].load() : 0; }
int64_t work(int phase, int tid) { return valid(phase, tid) ? g_work[phase][tid].load() : 0; }

}  // namespace bench_hooks
}  // namespace cpumoe
