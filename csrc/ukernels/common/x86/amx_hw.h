// The hardware side of amx_gemm.h's Tiles: the AMX tile instructions themselves.
// Features used: AMX-TILE, AMX-INT8, AMX-BF16 (the OS permission is the amx level's enable step,
// isa_table.def). The tests run the same kernels on tests_cpp/amx/amx_tile_model.h instead.
#pragma once

#if !defined(__AMX_TILE__) || !defined(__AMX_INT8__) || !defined(__AMX_BF16__)
#error "amx_hw.h needs -mamx-tile -mamx-int8 -mamx-bf16 (set per file by CMake)"
#endif

#include <immintrin.h>

#include <cstdint>

#include "ukernels/common/x86/amx_gemm.h"

namespace cpumoe {
namespace {

#define CPUMOE_AMX_EACH_TILE                                                             \
  CPUMOE_AMX_CASE(0) CPUMOE_AMX_CASE(1) CPUMOE_AMX_CASE(2) CPUMOE_AMX_CASE(3) CPUMOE_AMX_CASE(4) \
  CPUMOE_AMX_CASE(5) CPUMOE_AMX_CASE(6) CPUMOE_AMX_CASE(7)
#define CPUMOE_AMX_EACH_PRODUCT \
  CPUMOE_AMX_CASE(0, 4, 6) CPUMOE_AMX_CASE(1, 4, 7) CPUMOE_AMX_CASE(2, 5, 6) CPUMOE_AMX_CASE(3, 5, 7)

struct AmxHwTiles {
  struct Saved {
    amx::TileConfig cfg;
  };
  // sttilecfg stores zeros when the thread has no configuration; ldtilecfg zeroes the tile data
  // either way, so what is kept is the caller's configuration (its palette and shapes), which
  // code that keeps AMX configured between its own calls relies on.
  static void begin(Saved& s, const amx::TileConfig& cfg) {
    _tile_storeconfig(&s.cfg);
    _tile_loadconfig(&cfg);
  }
  static void end(const Saved& s) {
    if (s.cfg.palette_id != 0) _tile_loadconfig(&s.cfg);
    else _tile_release();
  }
  // GCC's _tile_* macros paste their tile operands into the asm text, so they take literal
  // numbers only: each template below expands to the one literal form it needs.
  template <int T>
  static void zero() {
#define CPUMOE_AMX_CASE(t) if constexpr (T == t) _tile_zero(t);
    CPUMOE_AMX_EACH_TILE
#undef CPUMOE_AMX_CASE
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
#define CPUMOE_AMX_CASE(t) if constexpr (T == t) _tile_loadd(t, p, stride);
    CPUMOE_AMX_EACH_TILE
#undef CPUMOE_AMX_CASE
  }
  template <int T>
  static void store(void* p, int64_t stride) {
#define CPUMOE_AMX_CASE(t) if constexpr (T == t) _tile_stored(t, p, stride);
    CPUMOE_AMX_EACH_TILE
#undef CPUMOE_AMX_CASE
  }
  // The dot products amx_gemm.h's tile issues: accumulator c from A tile 4 or 5 and B tile 6 or 7.
  template <int C, int A, int B>
  static void dpbusd() {
#define CPUMOE_AMX_CASE(c, a, b) if constexpr (C == c && A == a && B == b) _tile_dpbusd(c, a, b);
    CPUMOE_AMX_EACH_PRODUCT
#undef CPUMOE_AMX_CASE
    static_assert(is_product<C, A, B>(), "a tile product amx_gemm.h does not issue");
  }
  template <int C, int A, int B>
  static void dpbssd() {
#define CPUMOE_AMX_CASE(c, a, b) if constexpr (C == c && A == a && B == b) _tile_dpbssd(c, a, b);
    CPUMOE_AMX_EACH_PRODUCT
#undef CPUMOE_AMX_CASE
    static_assert(is_product<C, A, B>(), "a tile product amx_gemm.h does not issue");
  }
  template <int C, int A, int B>
  static void dpbf16ps() {
#define CPUMOE_AMX_CASE(c, a, b) if constexpr (C == c && A == a && B == b) _tile_dpbf16ps(c, a, b);
    CPUMOE_AMX_EACH_PRODUCT
#undef CPUMOE_AMX_CASE
    static_assert(is_product<C, A, B>(), "a tile product amx_gemm.h does not issue");
  }

 private:
  template <int C, int A, int B>
  static constexpr bool is_product() {
    return (C == 0 && A == 4 && B == 6) || (C == 1 && A == 4 && B == 7) ||
           (C == 2 && A == 5 && B == 6) || (C == 3 && A == 5 && B == 7);
  }
};

#undef CPUMOE_AMX_EACH_TILE
#undef CPUMOE_AMX_EACH_PRODUCT

}  // namespace
}  // namespace cpumoe
