// The logic of q4gemm_qs8rs_q4cio32x4_16x32_amx, the W4A8 GEMM on AMX-INT8 tiles, over amx_gemm.h's
// Tiles class: the kernel file instantiates it with the hardware tiles (amx_hw.h), the tests with
// the tile model (tests_cpp/amx/amx_tile_model.h), so both run exactly this code.
//
// Packing: the AVX-512 VNNI W4A8 kernel's (q4gemm_avx512_vnni.h), with A's rows padded to a
// multiple of 16 (zero rows, zero row sums), so calls of fewer than kAmxMinRows rows (decode) run
// through that kernel, which streams the weights at memory bandwidth where a mostly empty 16-row
// tile gains nothing.
//
// Tiles: tdpbssd (s8 x s8), so A is used as packed and the weights are decoded to their signed
// int8 values: no offset to take back. Per 32-column block of B and group of g k:
//   1. unpack the group's codes (g / 4 quads of 64 bytes, q4cio32x4) into a panel of two B tiles
//      per k step: columns 0-15 from the low nibbles, 16-31 from the high ones, each through one
//      vpshufb on the format's signed table (int4 is stored offset, u = v + 8: t[u] = u - 8;
//      mxfp4: t[c] = 2 * E2M1(c)); int8_affine's 8-bit codes (128 bytes per quad, the low half's
//      columns then the high half's) each through one xor, c ^ 0x80 = c - 128.
//      The panel (32 g bytes) stays in L1 while the row tiles pass;
//      the next group is unpacked into a second panel before this one's tiles run (a tile load
//      of what vector stores have just written waits for them).
//   2. per pair of 16-row tiles: the 2 x 2 accumulators zeroed, then per k step of ks bytes (64,
//      or 32 for groups that are an odd multiple of 32: the tiles are configured so) an A tile,
//      the two B tiles and 4 tdpbssd, so each accumulator holds the group's exact int32 sums;
//      stored, converted and multiplied by the group's scales into the rows' fp32 accumulators
//      (acc += float(isum) * s, in q4gemm.h's order: no FMA). A call of at most 16 rows (most
//      experts' at prefill) configures only its rows and alternates two accumulator sets.
// With lhs_group_scale each group's product also gets * the row's group scale.
// After the last group each row gets * lhs_scale, + bias, and masked stores (nothing past n).
// The int32 sums are exact (|sum| <= 128 * 128 * kW4MaxGroup < 2^31); the padding rows' results
// are dropped. fp32 accumulators: one block's 32 columns for every row of the call, in registers
// for calls of at most 8 rows (most experts' at T = 128), else in the call's scratch with the
// panels (scratch_bytes).
// Measured (Sapphire Rapids, one thread, n = 1536, k = 2048, cpumoe_q4gemm_bench): at m = 16,
// int4 g = 128 in 0.7x the VNNI kernel's time, mxfp4 and g = 32 in about 0.6x; at g = 32 the
// tiles take a store and an fp32 epilogue per 32 k, so they stay slower than the W8A8 tiles.
// Features used: AMX-TILE, AMX-INT8 (through Tiles), AVX-512 F/BW/VL/VNNI.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "cpumoe/q4gemm.h"
#include "ukernels/common/x86/amx_gemm.h"
#include "ukernels/common/x86/avx512_common.h"
#include "ukernels/q4gemm/x86/q4gemm_avx512_vnni.h"

namespace cpumoe {
namespace {
namespace q4_amx {

constexpr int64_t kMr = 16;          // rows of one A tile; lhs offsets are taken at multiples of it
constexpr int64_t kNr = q4_vnni::kNr;  // 32: one block gives the two B tiles of a k step
using Packing = q4_vnni::Packing;
// Below this many rows a call goes to the VNNI kernel (measured, one thread, n = 1536, k = 2048,
// int4 g = 128: at m = 2 both take 153 us; at m = 4 and 6 the tiles 155 us, VNNI 200 and 220).
constexpr int64_t kAmxMinRows = 4;
// Calls of at most this many rows keep their fp32 accumulators in registers (2 x 8 zmm).
constexpr int kRegRows = 8;

/// `qs8rs` with the rows padded to whole 16-row tiles (what the tiles read; their results dropped).
struct LhsPacking : Q4LhsRowSums {
  static size_t lhs_size(int64_t m, int64_t k) {
    return size_t(round_up(m, kMr)) * size_t(row_bytes(k));
  }
};

inline void pack_lhs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  pack_lhs_qs8rs(m, k, rows, packed);
  const size_t rb = size_t(Q4LhsRowSums::row_bytes(k));
  std::memset(static_cast<uint8_t*>(packed) + size_t(m) * rb, 0, size_t(round_up(m, kMr) - m) * rb);
}

/// Palette 1 with A tiles (4, 5) of @p rows rows x ks bytes, B tiles (6, 7) of ks / 4 rows x 64
/// bytes and the accumulators (0-3) of @p rows x 64 bytes. A call of at most 16 rows configures
/// just its rows: the tile loads, stores and dot products take time by the row.
inline amx::TileConfig tile_config(int64_t ks, int64_t rows) {
  amx::TileConfig cfg = amx::kernel_tile_config();
  for (int t : {0, 1, 2, 3, 4, 5}) cfg.rows[t] = uint8_t(rows);
  for (int t : {4, 5}) cfg.colsb[t] = uint16_t(ks);
  for (int t : {6, 7}) cfg.rows[t] = uint8_t(ks / 4);
  return cfg;
}

/// The codes' signed int8 values through one vpshufb (the stored codes, see the file comment);
/// 8-bit codes c through one xor (c - 128).
struct Unpack {
  __m512i mask, table;
  bool bytes;
  explicit Unpack(W4Format f) : bytes(f == W4Format::int8_affine) {
    const int8_t* t = w4_decode_table(f);
    alignas(16) int8_t v[16] = {};
    for (int c = 0; !bytes && c < 16; ++c) v[c] = f == W4Format::int4 ? int8_t(c - 8) : t[c];
    mask = _mm512_set1_epi8(bytes ? int8_t(0x80) : int8_t(0x0f));
    table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(v)));
  }
  // One quad (4 k of 32 columns) into its row of the low and the high B tile panels; the line
  // @p ahead bytes on (the next block's, as blocks are consecutive) is prefetched to L2, so the
  // weight stream does not wait for memory group by group.
  void quad(const uint8_t* p, uint8_t* lo, uint8_t* hi, int64_t ahead) const {
    _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
    const __m512i x = _mm512_loadu_si512(p);
    _mm512_store_si512(lo, _mm512_shuffle_epi8(table, _mm512_and_si512(x, mask)));
    const __m512i xh = _mm512_srli_epi16(x, 4);
    _mm512_store_si512(hi, _mm512_shuffle_epi8(table, _mm512_and_si512(xh, mask)));
  }
  // 8-bit codes: a quad's 128 bytes (the low half's 64, then the high half's) into the panels.
  void quad_bytes(const uint8_t* p, uint8_t* lo, uint8_t* hi, int64_t ahead) const {
    _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 64), _MM_HINT_T1);
    _mm512_store_si512(lo, _mm512_xor_si512(_mm512_loadu_si512(p), mask));
    _mm512_store_si512(hi, _mm512_xor_si512(_mm512_loadu_si512(p + 64), mask));
  }
  // A group of g k (g / 4 quads at @p grp) into @p panel (the low half, then the high one).
  void unpack(const uint8_t* grp, uint8_t* panel, int64_t g, int64_t ahead) const {
    if (bytes) {
      for (int64_t q = 0; q < g / 4; ++q)
        quad_bytes(grp + 128 * q, panel + 64 * q, panel + 16 * g + 64 * q, ahead);
      return;
    }
    for (int64_t q = 0; q < g / 4; ++q)
      quad(grp + 64 * q, panel + 64 * q, panel + 16 * g + 64 * q, ahead);
  }
};

/// The groups of the block at @p blk in order: body(gi, group bytes, its unpacked panel). The
/// next group is unpacked into the other panel before this group's body runs (a tile load of
/// data the vector stores have just written waits for them to complete).
template <class Body>
[[gnu::always_inline]] inline void each_group(const Unpack& up, const uint8_t* blk, int64_t g,
                                              int64_t groups, int64_t gbytes, int64_t bstride,
                                              uint8_t* const* panels, const Body& body) {
  up.unpack(blk, panels[0], g, bstride);
  for (int64_t gi = 0; gi < groups; ++gi) {
    const uint8_t* grp = blk + gi * gbytes;
    if (gi + 1 < groups) up.unpack(grp + gbytes, panels[(gi + 1) % 2], g, bstride);
    body(gi, grp, panels[gi % 2]);
  }
}

/// group_dots, then acc[i][0..32) += float(sum) * scale (* gs[i][gi] when gs, the rows' group
/// scales, row stride groups) for the rows < m.
template <class Tiles, int RT, int S, bool Mx>
inline void group_tiles(int64_t i0, int64_t m, const uint8_t* a, int64_t lda, const uint8_t* panel,
                        int64_t g, int64_t ks, const uint8_t* scales, int64_t hbytes, float* acc,
                        int32_t (*buf)[16][16], const float* gs, int64_t groups, int64_t gi) {
  constexpr int C0 = 2 * S;
  amx::group_dots<Tiles, amx::DotS8, RT, S>(a, lda, panel, g, ks, buf);
  const __m512 slo = q4_vnni::load_scales<Mx>(scales);
  const __m512 shi = q4_vnni::load_scales<Mx>(scales + hbytes);
  const int64_t rows = std::min<int64_t>(kMr * RT, m - i0);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = C0 + 2 * (i / kMr), r = i % kMr;
    float* ar = acc + (i0 + i) * kNr;
    __m512 fl = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(buf[t][r])), slo);
    __m512 fh = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(buf[t + 1][r])), shi);
    if (gs) {
      const __m512 ga = _mm512_set1_ps(gs[(i0 + i) * groups + gi]);
      fl = _mm512_mul_ps(fl, ga);
      fh = _mm512_mul_ps(fh, ga);
    }
    _mm512_store_ps(ar, _mm512_add_ps(_mm512_load_ps(ar), fl));
    _mm512_store_ps(ar + 16, _mm512_add_ps(_mm512_load_ps(ar + 16), fh));
  }
}

/// One block (32 columns at @p blk) of a call of at most 8 rows (@p m): as run_tiles' loop, with
/// the fp32 accumulators in registers over the groups (16 zmm) instead of in memory.
template <class Tiles, bool Mx>
inline void block_in_registers(int64_t m, int64_t j0, int64_t n, const uint8_t* a, int64_t lda,
                               const uint8_t* blk, int64_t g, int64_t groups, int64_t ks,
                               int64_t gbytes, int64_t cbytes, int64_t hbytes,
                               uint8_t* const* panels,
                               const Unpack& up, int64_t bstride, int32_t (*buf)[16][16],
                               const StoreF32Acc& store, const float* lhs_scale,
                               const float* gs) {
  __m512 lo[kRegRows], hi[kRegRows];
#pragma GCC unroll 8
  for (int r = 0; r < kRegRows; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  // Inlined whole (attribute), so that lo / hi stay in registers across the groups.
  const auto body = [&](int64_t gi, const uint8_t* grp,
                        const uint8_t* panel) __attribute__((always_inline)) {
    const uint8_t* ag = a + gi * g;
    int c0 = 0;
    if (gi % 2 == 0) amx::group_dots<Tiles, amx::DotS8, 1, 0>(ag, lda, panel, g, ks, buf);
    else amx::group_dots<Tiles, amx::DotS8, 1, 1>(ag, lda, panel, g, ks, buf), c0 = 2;
    const __m512 slo = q4_vnni::load_scales<Mx>(grp + cbytes);
    const __m512 shi = q4_vnni::load_scales<Mx>(grp + cbytes + hbytes);
#pragma GCC unroll 8
    for (int r = 0; r < kRegRows; ++r) {
      if (r >= m) break;
      __m512 fl = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(buf[c0][r])), slo);
      __m512 fh = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(buf[c0 + 1][r])), shi);
      if (gs) {  // the rows' group scales (lhs_group_scale), row stride groups
        const __m512 ga = _mm512_set1_ps(gs[r * groups + gi]);
        fl = _mm512_mul_ps(fl, ga);
        fh = _mm512_mul_ps(fh, ga);
      }
      lo[r] = _mm512_add_ps(lo[r], fl);
      hi[r] = _mm512_add_ps(hi[r], fh);
    }
  };
  each_group(up, blk, g, groups, gbytes, bstride, panels, body);
  const int64_t nlo = std::min<int64_t>(16, n - j0), nhi = std::min<int64_t>(16, n - j0 - 16);
#pragma GCC unroll 8
  for (int r = 0; r < kRegRows; ++r) {
    if (r >= m) break;
    const __m512 ls = _mm512_set1_ps(lhs_scale[r]);
    store(r, j0, nlo, _mm512_mul_ps(lo[r], ls));
    if (nhi > 0) store(r, j0 + 16, nhi, _mm512_mul_ps(hi[r], ls));
  }
}

// Scratch of a call (ep.scratch, 64-byte aligned): two group panels (each 2 halves x g / 4 rows
// x 64 bytes; see each_group), then m x 32 fp32 accumulators (unused for calls of at most
// kRegRows rows); none for the calls the VNNI kernel runs.
inline size_t scratch_bytes(int64_t m, int64_t n, int64_t /*k*/, const W4Layout& w) {
  if (m < kAmxMinRows || n <= 0) return 0;
  return (2 * size_t(8 * w.group) + size_t(m) * kNr) * sizeof(int32_t);
}

template <class Tiles, bool Mx>
void run_tiles(int64_t m, int64_t n, int64_t k, const W4Layout& w, const uint8_t* a,
               const uint8_t* rhs, float* dst, int64_t ld, const Q4GemmEpilogue& ep) {
  const int64_t g = w.group, groups = k / g, ks = g % 64 == 0 ? 64 : 32;
  const int64_t lda = Q4LhsRowSums::row_bytes(k), bstride = int64_t(Packing::block_bytes(k, w));
  const int64_t gbytes = Packing::group_bytes(w), cbytes = Packing::codes_bytes(w);
  const int64_t hbytes = 16 * w.scale_bytes();  // the high half's scales after the low's
  const size_t panel_i32 = size_t(8 * g);  // see scratch_bytes
  int32_t* scratch = static_cast<int32_t*>(ep.scratch);
  uint8_t* panels[2] = {reinterpret_cast<uint8_t*>(scratch),
                        reinterpret_cast<uint8_t*>(scratch + panel_i32)};
  float* acc = reinterpret_cast<float*>(scratch + 2 * panel_i32);
  const Unpack up(w.format);
  const amx::TileScope<Tiles> scope(tile_config(ks, std::min(m, kMr)));
  const StoreF32Acc store{dst, ld, ep.bias, ep.stream_dst};
  alignas(64) int32_t buf[4][16][16];  // the accumulators on their way to the fp32 epilogue
  for (int64_t j0 = 0; j0 < n; j0 += kNr) {
    const uint8_t* blk = rhs + (j0 / kNr) * bstride;
    if (m <= kRegRows) {
      block_in_registers<Tiles, Mx>(m, j0, n, a, lda, blk, g, groups, ks, gbytes, cbytes, hbytes,
                                    panels, up, bstride, buf, store, ep.lhs_scale,
                                    ep.lhs_group_scale);
      continue;
    }
    std::memset(acc, 0, size_t(m) * kNr * sizeof(float));
    each_group(up, blk, g, groups, gbytes, bstride, panels,
               [&](int64_t gi, const uint8_t* grp, const uint8_t* panel) {
      const uint8_t* ag = a + gi * g;
      const uint8_t* sc = grp + cbytes;
      const auto tiles = [&](auto rt, auto set, int64_t i0) {
        group_tiles<Tiles, decltype(rt)::value, decltype(set)::value, Mx>(
            i0, m, ag + i0 * lda, lda, panel, g, ks, sc, hbytes, acc, buf, ep.lhs_group_scale,
            groups, gi);
      };
      amx::group_row_tiles(m, gi, tiles);
    });
    for (int64_t hf = 0; hf < 2; ++hf) {
      const int64_t c0 = j0 + 16 * hf;
      if (c0 >= n) break;
      const int64_t nc = std::min<int64_t>(16, n - c0);
      for (int64_t i = 0; i < m; ++i)
        store(i, c0, nc, _mm512_mul_ps(_mm512_load_ps(acc + i * kNr + 16 * hf),
                                       _mm512_set1_ps(ep.lhs_scale[i])));
    }
  }
}

template <class Tiles>
void run_f32(int64_t m, int64_t n, int64_t k, const W4Layout& w, const void* lhs, const void* rhs,
             float* dst, int64_t dst_stride, const Q4GemmEpilogue& ep) {
  if (m <= 0 || n <= 0) return;
  if (m < kAmxMinRows) {
    q4_vnni::run_f32<true>(m, n, k, w, lhs, rhs, dst, dst_stride, ep);
    return;
  }
  const auto* a = static_cast<const uint8_t*>(lhs);
  const auto* b = static_cast<const uint8_t*>(rhs);
  if (w.format == W4Format::mxfp4) run_tiles<Tiles, true>(m, n, k, w, a, b, dst, dst_stride, ep);
  else run_tiles<Tiles, false>(m, n, k, w, a, b, dst, dst_stride, ep);
  if (ep.stream_dst) _mm_sfence();  // the non-temporal stores visible before the call returns
}

}  // namespace q4_amx
}  // namespace
}  // namespace cpumoe
