// f8gemm_bf16r_f8ci32x2_12x32_avx512_bf16: the W8A16 FP8 GEMM (bf16 activations x E4M3 codes with
// fp32 block scales) on AVX-512 BF16 (vdpbf16ps: 16 columns x 2 k per instruction, twice the
// products of an fp32 FMA).
//
// Layouts (F8Packing<32, 2, 2>; f8gemm_bf16_x86.h):
//   A (`bf16r`): row i at i * kp bf16, kp = round_up(k, 2), zero padded; one k pair (4 bytes)
//      broadcast to every lane.
//   B (`f8ci32x2`): blocks of 32 columns; per group one 64-byte step per k pair (column c's two
//      codes at 2c), then the group's 32 fp32 scales as given.
// Two paths, the same arithmetic:
//   - Few rows (m <= kDirectRows = 7: decode, and the small experts of prefill): one row tile
//     over column steps of 1 to 4 blocks; per k pair each block's 64 codes are decoded in
//     registers (f8_bf16::decode16x2, 6 instructions per 32 weights) and used by every row.
//   - More rows ("expand a weight panel once, use it for every row"): per block of 32 columns,
//     its codes over the whole depth decoded once into the caller's scratch (a panel of 64 kp
//     bytes of bf16), then every row tile of up to kPanelRows = 12 rows (24 accumulators) runs on
//     it: per k pair two loads, a broadcast and two vdpbf16ps per row, no decode. The scratch
//     holds two panels: while a block's row tiles run, they expand the next block's groups (spread
//     over the tiles), so the decode issues beside the vdpbf16ps chains (Zen 5, n 1536, k 2048,
//     m 32: 0.40 ms against 0.44 ms expanding up front; the fp32 kernel: 0.78 ms, decoding
//     again for every 8 rows at the fp32 FMA rate; the bf16 kernel on bf16 weights: 0.36 ms).
//     The first block is expanded up front.
//   Crossover: a 7-row direct tile decodes once too and skips the panel's stores and loads (m 6:
//   0.10 vs 0.11 ms); from 8 rows the panel tile's longer chains win (m 8: 0.12 vs 0.13 ms); a
//   direct tile of 10+ rows spills.
// Arithmetic (both paths, every output alike, whatever its tile or call): per group, the sum
// S' starts at +0 and takes one vdpbf16ps per k pair in k order (within a pair the hardware adds
// the odd k's product, then the even one's: bgemm_bf16r_bf16ci16x2_8x16_avx512_bf16.cpp); the
// products are exact (bf16 times 4 significant bits); at the group end acc = acc + (S' * 256) * s
// (S' * 256 is the group sum exactly, barring fp32 underflow), acc starting at 0; then + bias. So
// a row gives the same bits whichever path its call takes (the tester's calls at offsets mix
// them). vdpbf16ps reads bf16 subnormals in A as zero and flushes subnormal sums (f8gemm.h allows
// it); the weights are bf16 normals (f8gemm_bf16_x86.h).
// 4-bit codes (W4A16, F8Layout::code_bits 4): the same paths and arithmetic, each k pair step
// decoded by f8_bf16::Codes<4> from 32 bytes (4 instructions per 64 weights).
// Column tails are masked stores; stream_dst stores whole aligned lines non-temporally.
// Features used: AVX-512 F, BW, VL, BF16.
#if !defined(__x86_64__) || !defined(__AVX512F__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VL__) || !defined(__AVX512BF16__)
#error "f8gemm_bf16r_f8ci32x2_12x32_avx512_bf16.cpp needs -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx512bf16 (set per file by CMake)"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ukernels/common/ukernel_table.h"
#include "ukernels/common/x86/avx512_common.h"
#include "ukernels/f8gemm/x86/f8gemm_bf16_x86.h"

namespace cpumoe {
namespace {

using Packing = F8Packing</*Nr=*/f8_bf16::kNr, /*Kr=*/2, /*LhsBytes=*/2, /*LhsRows=*/1,
                          /*NibbleSpan=*/32>;
using f8_bf16::kPairBytes;

/// Calls of at most this many rows decode in registers (one row tile); larger ones expand.
constexpr int kDirectRows = 7;
/// Rows of a panel row tile (2 accumulators per row).
constexpr int kPanelRows = 12;

/// What a tile reads besides its position.
struct Call {
  F8Call l;  // the layout numbers (f8gemm_common.h); A rows are 2 kp bytes
  const uint8_t* a;  // packed A, row 0 of the call
  const uint8_t* b;  // packed B, block 0 of the call
  int64_t n;
  float* dst;
  int64_t ld;
  const F8GemmEpilogue& ep;
  __m512i tbl;  // f8_bf16::codebook_table (4-bit codes)
};

inline __m512 dot(__m512 s, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(s, (__m512bh)a, (__m512bh)b);
}
/// The k pair @p q of row @p r of the A tile at @p a, in every lane.
inline __m512i bcast_pair(const uint8_t* a, int64_t lda, int r, int64_t q) {
  return _mm512_set1_epi32(gemm_tile::load_i32(a + r * lda + 4 * q));
}
/// acc = acc + (S' * 256) * s, one vector of 16 columns (the order of f8gemm.h's sum).
inline void scale_add(float* acc, __m512 s, __m512 scale) {
  const __m512 sum = _mm512_mul_ps(s, _mm512_set1_ps(256.0f));
  _mm512_store_ps(acc, _mm512_add_ps(_mm512_load_ps(acc), _mm512_mul_ps(sum, scale)));
}

/// The fp32 totals at @p acc of rows [i0, i0 + MR) x blocks [jb, jb + NB) to dst (+ bias),
/// nothing past column n.
template <int MR, int NB>
inline void store_tile(const Call& c, const float (&acc)[MR][NB][2][16], int64_t i0,
                       int64_t jb) {
  const StoreF32Acc st{c.dst, c.ld, c.ep.bias, c.ep.stream_dst};
  for (int b = 0; b < NB; ++b)
    for (int h = 0; h < 2; ++h) {
      const int64_t j0 = (jb + b) * f8_bf16::kNr + 16 * h;
      if (j0 >= c.n) return;
      const int64_t nc = std::min<int64_t>(16, c.n - j0);
      for (int r = 0; r < MR; ++r) st(i0 + r, j0, nc, _mm512_load_ps(acc[r][b][h]));
    }
}

/// The direct path: rows [i0, i0 + MR) x blocks [jb, jb + NB), each k pair's codes decoded in
/// registers and used by every row.
template <int Bits, int MR, int NB>
void direct_tile(const Call& c, int64_t i0, int64_t jb) {
  using C = f8_bf16::Codes<Bits>;
  const C dec{c.tbl};
  const F8Call& l = c.l;
  const int64_t lda = 2 * l.kp;
  const uint8_t* a = c.a + i0 * lda;
  const uint8_t* bp = c.b + jb * l.block_bytes;
  alignas(64) float acc[MR][NB][2][16] = {};
  for (int64_t g = 0; g < l.groups; ++g) {
    const uint8_t* grp = bp + g * l.gstride;
    const uint8_t* ag = a + 2 * g * l.gk;
    const int64_t pairs = Packing::group_kp(g, l.k, *l.w) / 2;
    __m512 s[MR][NB][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) s[r][b][0] = s[r][b][1] = _mm512_setzero_ps();
    for (int64_t q = 0; q < pairs; ++q) {
      // Each block's stream kPrefetch bytes ahead; past the block's end, the same place in the
      // block NB on (the next column step's), so a new step does not start from memory.
      const int64_t ahead = g * l.gstride + q * C::kStep + f8_bf16::kPrefetch;
      const int64_t pf = ahead - g * l.gstride - q * C::kStep +
                         (ahead >= l.block_bytes ? (NB - 1) * l.block_bytes : 0);
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        const uint8_t* codes = grp + b * l.block_bytes + q * C::kStep;
        _mm_prefetch(reinterpret_cast<const char*>(codes + pf), _MM_HINT_T0);
        __m512i w0, w1;
        dec.decode(codes, w0, w1);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m512i av = bcast_pair(ag, lda, r, q);
          s[r][b][0] = dot(s[r][b][0], av, w0);
          s[r][b][1] = dot(s[r][b][1], av, w1);
        }
      }
    }
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const uint8_t* sp = f8_bf16::group_scales<Packing>(bp + b * l.block_bytes, l, g);
      const __m512 s0 = _mm512_loadu_ps(sp), s1 = _mm512_loadu_ps(sp + 64);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        scale_add(acc[r][b][0], s[r][b][0], s0);
        scale_add(acc[r][b][1], s[r][b][1], s1);
      }
    }
  }
  store_tile<MR, NB>(c, acc, i0, jb);
}

/// The panel path: rows [i0, i0 + MR) x block jb, its weights read from @p panel (the block's
/// expansion). The tile also expands groups [eg0, eg1) of the next block (codes at @p next) into
/// @p next_panel, a k pair per k pair: the decode's integer and permute instructions then issue
/// beside the vdpbf16ps chains instead of before them (the walk spreads the groups over the row
/// tiles).
template <int Bits, int MR>
void panel_tile(const Call& c, const uint8_t* panel, int64_t i0, int64_t jb, const uint8_t* next,
                uint8_t* next_panel, int64_t eg0, int64_t eg1) {
  using C = f8_bf16::Codes<Bits>;
  const C dec{c.tbl};
  const F8Call& l = c.l;
  const int64_t lda = 2 * l.kp;
  const uint8_t* a = c.a + i0 * lda;
  const uint8_t* bp = c.b + jb * l.block_bytes;
  const int64_t half = f8_bf16::half_bytes(l.kp);
  alignas(64) float acc[MR][1][2][16] = {};
  for (int64_t g = 0; g < l.groups; ++g) {
    const uint8_t* ag = a + 2 * g * l.gk;
    const int64_t pairs = Packing::group_kp(g, l.k, *l.w) / 2, q0 = g * l.gk / 2;
    const uint8_t* p0 = panel + q0 * kPairBytes;
    __m512 s[MR][2];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    // The group's k pairs, with (Ex) or without the next block's expansion: two loops, so the
    // plain one carries no test.
    const auto pairs_loop = [&](auto ex) {
      constexpr bool kEx = decltype(ex)::value;
      const uint8_t* src = kEx ? next + g * l.gstride : nullptr;
      uint8_t* dst = kEx ? next_panel + q0 * kPairBytes : nullptr;
      for (int64_t q = 0; q < pairs; ++q) {
        if constexpr (kEx) {
          const uint8_t* cq = src + q * C::kStep;
          _mm_prefetch(reinterpret_cast<const char*>(cq + f8_bf16::kPrefetchExpand), _MM_HINT_T0);
          __m512i e0, e1;
          dec.decode(cq, e0, e1);
          _mm512_store_si512(dst + q * kPairBytes, e0);
          _mm512_store_si512(dst + half + q * kPairBytes, e1);
        }
        const __m512i w0 = _mm512_load_si512(p0 + q * kPairBytes);
        const __m512i w1 = _mm512_load_si512(p0 + half + q * kPairBytes);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const __m512i av = bcast_pair(ag, lda, r, q);
          s[r][0] = dot(s[r][0], av, w0);
          s[r][1] = dot(s[r][1], av, w1);
        }
      }
    };
    if (g >= eg0 && g < eg1) pairs_loop(std::true_type{});
    else pairs_loop(std::false_type{});
    const uint8_t* sp = f8_bf16::group_scales<Packing>(bp, l, g);
    const __m512 s0 = _mm512_loadu_ps(sp), s1 = _mm512_loadu_ps(sp + 64);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      scale_add(acc[r][0][0], s[r][0], s0);
      scale_add(acc[r][0][1], s[r][1], s1);
    }
  }
  store_tile<MR, 1>(c, acc, i0, jb);
}

/// Blocks per column step of the direct path for a tile of @p rows: more weight streams and
/// independent chains for fewer rows (16 accumulators from 2 rows up).
constexpr int direct_blocks(int rows) { return rows <= 2 ? 4 : rows <= 4 ? 2 : 1; }

template <int Bits>
struct DirectPick {
  using Fn = void (*)(const Call&, int64_t, int64_t);
  template <int MR, int NB>
  static constexpr Fn fn() {
    if constexpr (NB <= direct_blocks(MR)) return &direct_tile<Bits, MR, NB>;
    else return nullptr;
  }
};
template <int Bits>
struct PanelPick {
  using Fn = void (*)(const Call&, const uint8_t*, int64_t, int64_t, const uint8_t*, uint8_t*,
                      int64_t, int64_t);
  template <int MR, int NB>
  static constexpr Fn fn() { return &panel_tile<Bits, MR>; }
};

size_t scratch_bytes(int64_t m, int64_t n, int64_t k, const F8Layout&) {
  // Only the panel path has scratch: two blocks' panels (the current one and the next, which
  // the current one's first row tile expands). Non-decreasing in m and n.
  if (m <= kDirectRows || n <= 0) return 0;
  return 2 * f8_bf16::panel_bytes(Packing::padded_k(k));
}

// run_f32 for codes of Bits bits.
template <int Bits>
void run(const Call& c, int64_t m) {
  using Direct = DirectPick<Bits>;
  using Panel = PanelPick<Bits>;
  const int64_t blocks = (c.n + f8_bf16::kNr - 1) / f8_bf16::kNr;
  if (m <= kDirectRows) {
    static constexpr auto table =
        TileFnGrid<Direct, typename Direct::Fn, kDirectRows, direct_blocks(1)>::table;
    const int64_t step = direct_blocks(int(m));
    for (int64_t jb = 0; jb < blocks; jb += step)
      table[size_t(m - 1)][size_t(std::min(step, blocks - jb) - 1)](c, 0, jb);
    return;
  }
  static constexpr auto table = TileFnGrid<Panel, typename Panel::Fn, kPanelRows, 1>::table;
  uint8_t* panels[2] = {static_cast<uint8_t*>(c.ep.scratch),
                        static_cast<uint8_t*>(c.ep.scratch) + f8_bf16::panel_bytes(c.l.kp)};
  const int64_t tiles = (m + kPanelRows - 1) / kPanelRows;
  f8_bf16::expand<Packing>(c.b, c.l, f8_bf16::Codes<Bits>{c.tbl}, panels[0]);
  for (int64_t jb = 0; jb < blocks; ++jb) {
    const uint8_t* panel = panels[jb & 1];
    uint8_t* next_panel = panels[(jb + 1) & 1];
    const uint8_t* next = jb + 1 < blocks ? c.b + (jb + 1) * c.l.block_bytes : nullptr;
    for (int64_t t = 0, i0 = 0; t < tiles; ++t) {
      // Rows split evenly over the fewest tiles (17 rows: 9 + 8, not 12 + 5); the next block's
      // groups split over the tiles too (none after the last block).
      const int64_t rows = (m - i0 + (tiles - t) - 1) / (tiles - t);
      const int64_t eg0 = next != nullptr ? t * c.l.groups / tiles : 0;
      const int64_t eg1 = next != nullptr ? (t + 1) * c.l.groups / tiles : 0;
      table[size_t(rows - 1)][0](c, panel, i0, jb, next, next_panel, eg0, eg1);
      i0 += rows;
    }
  }
}

void run_f32(int64_t m, int64_t n, int64_t k, const F8Layout& w, const void* lhs, const void* rhs,
             float* dst, int64_t ld, const F8GemmEpilogue& ep) {
  if (m <= 0 || n <= 0) return;
  const Call c{f8_call<Packing>(k, w), static_cast<const uint8_t*>(lhs),
               static_cast<const uint8_t*>(rhs), n, dst, ld, ep, f8_bf16::codebook_table(w)};
  if (w.code_bits == 4) run<4>(c, m);
  else run<8>(c, m);
  if (ep.stream_dst) _mm_sfence();  // the non-temporal stores visible before the call returns
}

}  // namespace

extern const F8GemmUkernel f8gemm_bf16r_f8ci32x2_12x32_avx512_bf16 = make_f8gemm<Packing>(
    "f8gemm_bf16r_f8ci32x2_12x32_avx512_bf16", Isa::avx512_bf16, kPanelRows,
    pack_lhs_bf16r<Packing>, pack_rhs_f8<Packing, f8_bf16::Arrange>, run_f32, scratch_bytes);

}  // namespace cpumoe
