// The tile-only loop behind measure_amx_peak (probes.h), built with the amx level's flags; called
// only from probes.cpp after cpu_supports(Isa::amx).
#if !defined(__AMX_TILE__) || !defined(__AMX_INT8__) || !defined(__AMX_BF16__)
#error "amx_peak.cpp needs the amx level's flags (set per file by CMake)"
#endif

#include <chrono>
#include <cstdint>

#include "ukernels/common/x86/amx_hw.h"

namespace cpumoe {
namespace probe_detail {
namespace {

// Seconds for `reps` rounds of the 2 x 2 tile's four products (amx_gemm.h's tile), of one kind.
template <bool Bf16>
double timed_products(int64_t reps) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < reps; ++i) {
    if constexpr (Bf16) {
      AmxHwTiles::dpbf16ps<0, 4, 6>();
      AmxHwTiles::dpbf16ps<1, 4, 7>();
      AmxHwTiles::dpbf16ps<2, 5, 6>();
      AmxHwTiles::dpbf16ps<3, 5, 7>();
    } else {
      AmxHwTiles::dpbusd<0, 4, 6>();
      AmxHwTiles::dpbusd<1, 4, 7>();
      AmxHwTiles::dpbusd<2, 5, 6>();
      AmxHwTiles::dpbusd<3, 5, 7>();
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// Seconds for `reps` x 4 tile products of each kind on the calling thread: {int8, bf16}.
void amx_tile_loop(int64_t reps, double* int8_seconds, double* bf16_seconds) {
  alignas(64) static const uint8_t operand[1024] = {1};
  const amx::TileScope<AmxHwTiles> tiles;  // the kernels' configuration, the caller's restored
  AmxHwTiles::load<4>(operand, 64);
  AmxHwTiles::load<5>(operand, 64);
  AmxHwTiles::load<6>(operand, 64);
  AmxHwTiles::load<7>(operand, 64);
  AmxHwTiles::zero<0>();
  AmxHwTiles::zero<1>();
  AmxHwTiles::zero<2>();
  AmxHwTiles::zero<3>();
  *int8_seconds = timed_products<false>(reps);
  *bf16_seconds = timed_products<true>(reps);
}

}  // namespace probe_detail
}  // namespace cpumoe
