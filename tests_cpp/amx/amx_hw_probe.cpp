// The real tile instructions on one tile each, for the test that holds the tile model against
// the hardware (test_amx_tiles.cpp). Built with the amx level's flags; call only where
// cpu_supports(Isa::amx) holds. Plain arrays only (see amx_model_kernels.cpp on shared code).
#if !defined(__AMX_TILE__) || !defined(__AMX_INT8__) || !defined(__AMX_BF16__)
#error "amx_hw_probe.cpp needs the amx level's flags"
#endif

#include "amx/amx_probe.h"

#include <immintrin.h>

#include <cstring>

#include "ukernels/common/x86/amx_gemm.h"

namespace cpumoe_test {
namespace {
// tmm0 C (16 x 64 bytes), tmm1 A (16 rows x a_colsb), tmm2 B (a_colsb / 4 rows x 64 bytes).
void configure(int a_colsb) {
  cpumoe::amx::TileConfig cfg = cpumoe::amx::kernel_tile_config();
  cfg.colsb[1] = uint16_t(a_colsb);
  cfg.rows[2] = uint8_t(a_colsb / 4);
  _tile_loadconfig(&cfg);
}
}  // namespace

void amx_hw_dpbusd(const void* a, const void* b, void* c) {
  configure(64);
  _tile_loadd(0, c, 64);
  _tile_loadd(1, a, 64);
  _tile_loadd(2, b, 64);
  _tile_dpbusd(0, 1, 2);
  _tile_stored(0, c, 64);
  _tile_release();
}

void amx_hw_dpbssd(const void* a, const void* b, void* c) {
  configure(64);
  _tile_loadd(0, c, 64);
  _tile_loadd(1, a, 64);
  _tile_loadd(2, b, 64);
  _tile_dpbssd(0, 1, 2);
  _tile_stored(0, c, 64);
  _tile_release();
}

void amx_hw_dpbf16ps(const void* a, const void* b, void* c, int pairs) {
  configure(4 * pairs);
  _tile_loadd(0, c, 64);
  _tile_loadd(1, a, 64);
  _tile_loadd(2, b, 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, c, 64);
  _tile_release();
}

void amx_hw_storeconfig(void* cfg64) { _tile_storeconfig(cfg64); }
void amx_hw_loadconfig(const void* cfg64) { _tile_loadconfig(cfg64); }
void amx_hw_release() { _tile_release(); }

}  // namespace cpumoe_test
