// The AMX tile walk shared by the AMX kernels (int8 tdpbusd, bf16 tdpbf16ps). It is written over
// a Tiles class, so the same code runs on the hardware (amx_hw.h) and, in the tests, on a plain
// C++ model of the tile instructions (tests_cpp/amx/amx_tile_model.h): tiling, packing, row and
// column edges and the epilogue are checked bit for bit on machines without AMX.
//
//   struct Tiles {
//     struct Saved;                             // the thread's previous tile configuration
//     static void begin(Saved&, const TileConfig&);  // saves it, loads the kernel's (below)
//     static void end(const Saved&);            // restores it (or releases the tiles)
//     template <int T> static void zero();
//     template <int T> static void load(const void* p, int64_t stride);   // 16 rows x 64 bytes
//     template <int T> static void store(void* p, int64_t stride);
//     template <int C, int A, int B> static void dpbusd();    // C.s32 += u8(A) . s8(B), groups of 4
//     template <int C, int A, int B> static void dpbssd();    // C.s32 += s8(A) . s8(B), groups of 4
//     template <int C, int A, int B> static void dpbf16ps();  // C.f32 += bf16(A) . bf16(B), pairs
//   };
//   struct Ops {                                // the kernel's arithmetic
//     using Acc = int32_t | float;              // accumulator element
//     using Vec = __m512i | __m512;             // one finished row of 16 columns, to the store
//     template <class Tiles, int C, int A, int B> static void dot();
//     static Vec finish(const Acc* row, const uint8_t* block_end);  // block_end: after the block's steps
//   };
//
// Operands (both kernels): A has round_up(m, 16) rows of row_bytes (a multiple of 64) each, the
// padding rows zero, so every A tile is a full 16 x 64-byte tile and no tile is reconfigured for
// an edge; their results are simply not stored. B comes in blocks of 16 output columns at
// b + j * bstride; the block's k step s (64 bytes of an A row: 64 int8 or 32 bf16) is one
// 16-row x 64-byte tile at + 1024 s (16 groups of 4 int8 or 2 bf16 k per column, one 4-byte lane
// per column). The walk: column pairs outer, pairs of row tiles inner, each 2 x 2 tile (32 rows x
// 32 columns, tmm0-3) over the whole depth (tmm4-5 A, tmm6-7 B), 1 x 2 / 2 x 1 / 1 x 1 at the
// edges. A pair's weights (2 x 16 x row_bytes) stay in L2 while its row tiles pass; while the
// first row tile streams them in, the next pair's are prefetched to L2, so the weight stream from
// memory does not wait for the tiles. The accumulators go through a 4 KB stack buffer to the
// kernel's AVX-512 epilogue (Ops::finish and the store functor).
// Internal linkage on purpose (see qgemm_common.h): each file instantiates it with its own flags.
#pragma once

#if !defined(__AVX512F__)
#error "amx_gemm.h is for files built with the AVX-512 (and, for the hardware tiles, AMX) flags only"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace cpumoe {
namespace {
namespace amx {

/// The ldtilecfg operand (64 bytes, palette 1).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "the architectural tile configuration is 64 bytes");

/// What every AMX kernel here configures: palette 1, tiles 0-7 of 16 rows x 64 bytes.
inline TileConfig kernel_tile_config() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  return cfg;
}

constexpr int64_t kTileRows = 16;     // rows of an A tile and of an accumulator
constexpr int64_t kStepBytes = 64;    // bytes of an A row per k step
constexpr int64_t kBTileBytes = 1024; // one B tile: 16 groups x 64 bytes

/// The thread's tiles configured as @p cfg for the scope's lifetime; the configuration the thread
/// had before (a caller that uses AMX itself, e.g. oneDNN inside torch) is put back.
template <class Tiles>
class TileScope {
 public:
  explicit TileScope(const TileConfig& cfg = kernel_tile_config()) { Tiles::begin(saved_, cfg); }
  ~TileScope() { Tiles::end(saved_); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  typename Tiles::Saved saved_;
};

/// The tile product of a grouped kernel (q4gemm int8, f8gemm bf16): C += A . B on the tiles.
struct DotS8 {
  using Acc = int32_t;
  template <class Tiles, int C, int A, int B> static void dot() {
    Tiles::template dpbssd<C, A, B>();
  }
};
struct DotBf16 {
  using Acc = float;
  template <class Tiles, int C, int A, int B> static void dot() {
    Tiles::template dpbf16ps<C, A, B>();
  }
};

/// Rows [0, 16 RT) of A (at @p a, the group's first byte) x a 32-column panel of one k group
/// (@p a_bytes bytes of each A row; steps of @p a_step bytes, a_step <= 64): the sums on the
/// tiles, stored to buf[accumulator]. The panel holds each 16-column half as 16 a_bytes bytes,
/// a step's B tile at 16 a_step s. RT = 2 takes accumulators 0-3 and A tiles 4, 5; RT = 1 takes
/// accumulators 2 S, 2 S + 1 and A tile 4 + S, so that consecutive groups alternate S: the tiles
/// are not renamed, and one set's dot products then overlap the other's stores and fp32 epilogue
/// instead of waiting for them.
template <class Tiles, class Dot, int RT, int S>
inline void group_dots(const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t a_bytes,
                       int64_t a_step, typename Dot::Acc (*buf)[16][16]) {
  static_assert(RT == 2 ? S == 0 : (S == 0 || S == 1), "RT = 2 uses every accumulator");
  constexpr int C0 = 2 * S, C1 = 2 * S + 1, A0 = 4 + S;
  Tiles::template zero<C0>();
  Tiles::template zero<C1>();
  if constexpr (RT > 1) {
    Tiles::template zero<2>();
    Tiles::template zero<3>();
  }
  const int64_t half = 16 * a_bytes;  // bytes of one half's panel
  for (int64_t k0 = 0; k0 < a_bytes; k0 += a_step) {
    const uint8_t* b = panel + 16 * k0;  // a_step / 4 rows of 64 bytes per step
    Tiles::template load<A0>(a + k0, lda);
    Tiles::template load<6>(b, 64);
    Tiles::template load<7>(b + half, 64);
    Dot::template dot<Tiles, C0, A0, 6>();
    Dot::template dot<Tiles, C1, A0, 7>();
    if constexpr (RT > 1) {
      Tiles::template load<5>(a + kTileRows * lda + k0, lda);
      Dot::template dot<Tiles, 2, 5, 6>();
      Dot::template dot<Tiles, 3, 5, 7>();
    }
  }
  Tiles::template store<C0>(buf[C0], 64);
  Tiles::template store<C1>(buf[C1], 64);
  if constexpr (RT > 1) {
    Tiles::template store<2>(buf[2], 64);
    Tiles::template store<3>(buf[3], 64);
  }
}

/// The row tiles of one k group of a grouped kernel (q4gemm, f8gemm): tiles(RT, set, i0) for
/// RT = 1 or 2 row tiles of 16 from row i0. With one row tile the groups alternate between tile
/// sets 0 and 1 (@p g odd or even), so a group's loads need not wait for the previous group's
/// stores; more rows go in pairs of row tiles on set 0.
template <class F>
[[gnu::always_inline]] inline void group_row_tiles(int64_t m, int64_t g, F&& tiles) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Set0 = std::integral_constant<int, 0>;
  constexpr int64_t kMr = 16;
  if (m <= kMr) {
    if (g % 2 == 0) tiles(One{}, Set0{}, 0);
    else tiles(One{}, One{}, 0);
    return;
  }
  for (int64_t i0 = 0; i0 < m; i0 += 2 * kMr) {
    if (m - i0 > kMr) tiles(Two{}, Set0{}, i0);
    else tiles(One{}, Set0{}, i0);
  }
}

/// Rows [i0, i0 + rows) (rows <= 16 RT) x columns [j0, j0 + 16 CT) (clipped to n) over the
/// whole depth (@p steps k steps): A tile r at a + 16 r lda, B block c at b + c bstride. While it
/// runs, the @p pf_blocks blocks at pf (stride bstride) are prefetched, one line per 64 bytes.
template <class Tiles, class Ops, int RT, int CT, class Store>
inline void tile(int64_t i0, int64_t rows, int64_t j0, int64_t n, const uint8_t* a, int64_t lda,
                 const uint8_t* b, int64_t bstride, int64_t steps, const uint8_t* pf,
                 int64_t pf_blocks, const Store& store) {
  Tiles::template zero<0>();
  if constexpr (CT > 1) Tiles::template zero<1>();
  if constexpr (RT > 1) Tiles::template zero<2>();
  if constexpr (RT > 1 && CT > 1) Tiles::template zero<3>();
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t j = 0; j < pf_blocks; ++j)
      for (int64_t l = 0; l < kBTileBytes; l += 64)
        __builtin_prefetch(pf + j * bstride + kBTileBytes * s + l, 0, 2);
    Tiles::template load<4>(a + kStepBytes * s, lda);
    Tiles::template load<6>(b + kBTileBytes * s, kStepBytes);
    Ops::template dot<Tiles, 0, 4, 6>();
    if constexpr (CT > 1) {
      Tiles::template load<7>(b + bstride + kBTileBytes * s, kStepBytes);
      Ops::template dot<Tiles, 1, 4, 7>();
    }
    if constexpr (RT > 1) {
      Tiles::template load<5>(a + kTileRows * lda + kStepBytes * s, lda);
      Ops::template dot<Tiles, 2, 5, 6>();
      if constexpr (CT > 1) Ops::template dot<Tiles, 3, 5, 7>();
    }
  }
  alignas(64) typename Ops::Acc buf[4][16][16];
  Tiles::template store<0>(buf[0], 64);
  if constexpr (CT > 1) Tiles::template store<1>(buf[1], 64);
  if constexpr (RT > 1) Tiles::template store<2>(buf[2], 64);
  if constexpr (RT > 1 && CT > 1) Tiles::template store<3>(buf[3], 64);
  for (int c = 0; c < CT; ++c) {
    const uint8_t* block_end = b + c * bstride + kBTileBytes * steps;
    const int64_t c0 = j0 + 16 * c;
    const int64_t nc = std::min<int64_t>(16, n - c0);
    for (int r = 0; r < RT; ++r) {
      const int64_t valid = std::min<int64_t>(16, rows - 16 * r);
      for (int64_t i = 0; i < valid; ++i)
        store(i0 + 16 * r + i, c0, nc, Ops::finish(buf[2 * r + c][i], block_end));
    }
  }
}

/// C[0, m) x [0, n) on the tiles (layouts above; A padded to whole 16-row tiles).
template <class Tiles, class Ops, class Store>
void run(int64_t m, int64_t n, int64_t row_bytes, const uint8_t* a, const uint8_t* b,
         int64_t bstride, const Store& store) {
  if (m <= 0 || n <= 0) return;
  const TileScope<Tiles> scope;
  const int64_t steps = row_bytes / kStepBytes;
  const int64_t blocks = (n + 15) / 16;
  for (int64_t jb = 0; jb < blocks; jb += 2) {
    const bool two_cols = jb + 1 < blocks;
    const uint8_t* bj = b + jb * bstride;
    const int64_t j0 = 16 * jb;
    const int64_t next = std::min<int64_t>(2, blocks - jb - 2);  // blocks of the next pair
    for (int64_t i0 = 0; i0 < m; i0 += 2 * kTileRows) {
      const int64_t rows = std::min<int64_t>(2 * kTileRows, m - i0);
      const bool two_rows = rows > kTileRows;
      const uint8_t* ai = a + i0 * row_bytes;
      const uint8_t* pf = i0 == 0 && next > 0 ? bj + 2 * bstride : nullptr;
      const int64_t pfb = pf != nullptr ? next : 0;
      if (two_rows && two_cols)
        tile<Tiles, Ops, 2, 2>(i0, rows, j0, n, ai, row_bytes, bj, bstride, steps, pf, pfb, store);
      else if (two_rows)
        tile<Tiles, Ops, 2, 1>(i0, rows, j0, n, ai, row_bytes, bj, bstride, steps, pf, pfb, store);
      else if (two_cols)
        tile<Tiles, Ops, 1, 2>(i0, rows, j0, n, ai, row_bytes, bj, bstride, steps, pf, pfb, store);
      else
        tile<Tiles, Ops, 1, 1>(i0, rows, j0, n, ai, row_bytes, bj, bstride, steps, pf, pfb, store);
    }
  }
}

}  // namespace amx
}  // namespace
}  // namespace cpumoe
