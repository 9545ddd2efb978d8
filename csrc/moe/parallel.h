// The dispatcher's threading: how many threads a call gets and the one parallel loop every phase
// uses. Every loop is over independent items, each written by exactly one thread, so results never
// depend on the thread count.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <type_traits>

#include "bench_hooks.h"  // no-ops unless built with CPUMOE_BENCH_HOOKS

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace cpumoe {
namespace moe_detail {

// A thread count above this (and above both the processor count and OMP_NUM_THREADS) is capped:
// results do not depend on it, and asking libgomp for a million threads would abort the process.
constexpr int kMaxThreads = 256;

// Below this much work (in elements touched) a row phase runs on the calling thread: waking the
// team costs more (with OMP_WAIT_POLICY=PASSIVE, tens of microseconds) than, at decode, packing
// or activating the few rows of 8 experts.
constexpr int64_t kMinParallelWork = int64_t(1) << 16;

inline int resolve_threads(int n) {
#if defined(_OPENMP)
  if (n <= 0) return std::max(1, omp_get_max_threads());
  return std::min(n, std::max({kMaxThreads, omp_get_num_procs(), omp_get_max_threads()}));
#else
  (void)n;
  return 1;
#endif
}

// Runs item i of a loop on thread tid and returns the work it reports: a body may return the
// work the item did (multiply-adds of a GEMM task), which only the bench hooks read.
template <class Fn>
inline int64_t call_item(const Fn& fn, int64_t i, int tid) {
  if constexpr (std::is_void_v<decltype(fn(i, tid))>) {
    fn(i, tid);
    return 0;
  } else {
    return fn(i, tid);
  }
}

// One item of a parallel loop, counted for the bench (a normal build discards the work).
template <class Fn>
inline void run_item(const Fn& fn, int64_t i, int tid) {
  const int64_t work = call_item(fn, i, tid);
  CPUMOE_BENCH_TASK(tid, work);
  (void)work;
}

// Runs fn(i, tid) for i in [0, n) on up to `threads` threads, dynamically scheduled; tid in
// [0, threads) indexes per-thread scratch. It is this loop's own index, never a caller's (a
// caller may itself be inside an OpenMP region).
// An exception thrown by an item (std::bad_alloc while packing, an ArgumentError) must not leave
// an OpenMP region, where it would end the process: the first one is kept, the items not yet
// started are skipped, and it is rethrown on the calling thread after the region.
template <class Fn>
void parallel_for(int64_t n, int threads, const Fn& fn) {
#if defined(_OPENMP)
  if (threads > 1 && n > 1) {
    const int team = int(std::min<int64_t>(threads, n));  // no idle threads to wake
    std::exception_ptr first;
    std::atomic<bool> failed{false};
#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
    for (int64_t i = 0; i < n; ++i) {
      if (failed.load(std::memory_order_relaxed)) continue;
      try {
        run_item(fn, i, omp_get_thread_num());
      } catch (...) {
#pragma omp critical(cpumoe_parallel_for_error)
        if (!failed.exchange(true)) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
    return;
  }
#endif
  (void)threads;
  for (int64_t i = 0; i < n; ++i) run_item(fn, i, 0);
}

// parallel_for for a row phase of n items of about `work` elements each: one thread when the
// whole phase is small (results never depend on the thread count).
template <class Fn>
void parallel_rows(int64_t n, int64_t work, int threads, const Fn& fn) {
  parallel_for(n, n * work < kMinParallelWork ? 1 : threads, fn);
}

}  // namespace moe_detail
}  // namespace cpumoe
