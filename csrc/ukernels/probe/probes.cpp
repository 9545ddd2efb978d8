// measure_amx_peak (probes.h): runs the tile loop of amx_peak.cpp on N threads at once. Built
// without ISA flags.
#include "cpumoe/probes.h"

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "cpumoe/cpu_features.h"

namespace cpumoe {
#if defined(CPUMOE_HAVE_AMX_PROBE)
namespace probe_detail {
void amx_tile_loop(int64_t reps, double* int8_seconds, double* bf16_seconds);
}
#endif

bool measure_amx_peak(int threads, double seconds, AmxPeak* out) {
#if defined(CPUMOE_HAVE_AMX_PROBE)
  if (!cpu_supports(Isa::amx) || threads < 1 || !(seconds > 0) || out == nullptr) return false;
  // Calibrate on one thread, then every thread runs the same count at once; the slowest
  // thread's time gives the rate of all of them together.
  int64_t reps = 1 << 14;
  double s8 = 0, s16 = 0;
  for (;;) {
    probe_detail::amx_tile_loop(reps, &s8, &s16);
    if (s8 + s16 >= 0.02 || reps >= (int64_t(1) << 34)) break;
    reps *= 4;
  }
  reps = std::max<int64_t>(1, int64_t(double(reps) * seconds / std::max(s8 + s16, 1e-9)));
  std::vector<double> t8(static_cast<size_t>(threads)), t16(static_cast<size_t>(threads));
  std::vector<std::thread> team;
  for (int t = 0; t < threads; ++t)
    team.emplace_back([&, t] { probe_detail::amx_tile_loop(reps, &t8[size_t(t)], &t16[size_t(t)]); });
  for (auto& th : team) th.join();
  const double per_rep = 4.0 * 16 * 16 * 64 * 2;  // 4 products of 16 x 16 x 64 multiply-adds
  out->int8_ops = per_rep * double(reps) * threads / *std::max_element(t8.begin(), t8.end());
  out->bf16_flops = per_rep / 2 * double(reps) * threads / *std::max_element(t16.begin(), t16.end());
  return true;
#else
  (void)threads;
  (void)seconds;
  (void)out;
  return false;
#endif
}

}  // namespace cpumoe
