// The tile-only loop behind measure_amx_peak (probes.h), built with the amx level's flags; called
// only from probes.cpp after cpu_supports(Isa::amx).
#if !defined(__AMX_TILE__) || !defined(__AMX_INT8__) || !defined(__AMX_BF16__)
#error "amx_peak.cpp needs the amx level's flags (set per file by CMake)"
#endif

#include <immintrin.h>

#include <chrono>
#include <cstdint>

#include "ukernels/common/x86/amx_hw.h"

namespace cpumoe {
namespace probe_detail {

// Seconds for `reps` x 4 tile products of each kind on the calling thread: {int8, bf16}.
void amx_tile_loop(int64_t reps, double* int8_seconds, double* bf16_seconds) {
  alignas(64) static const uint8_t operand[1024] = {1};
  AmxHwTiles::Saved saved;
  AmxHwTiles::begin(saved);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < reps; ++i) {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  auto t1 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < reps; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  auto t2 = std::chrono::steady_clock::now();
  AmxHwTiles::end(saved);
  *int8_seconds = std::chrono::duration<double>(t1 - t0).count();
  *bf16_seconds = std::chrono::duration<double>(t2 - t1).count();
}

}  // namespace probe_detail
}  // namespace cpumoe
