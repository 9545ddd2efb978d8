// q4gemm_qs8rs_q4ci8x8_4x8_avx2: the W4A8 GEMM (int8 activations x int4 / mxfp4 codes, or
// int8_affine's 8-bit codes, with group scales) on AVX2 (Haswell and later, no VNNI needed).
//
// As the AVX-512 VNNI kernel, the weights are decoded (vpshufb on a 16-byte table, both formats)
// to unsigned u = v + off (off 8 for int4, 12 for mxfp4, u <= 24) and A stays signed; here the
// product is vpmaddubsw (u8 x s8 pairs into int16, saturating), which is exact because u is small:
// one pair is at most 2 * 24 * 128 = 6144 in magnitude, and the pairs of the two 4-k halves of an
// 8-k slice add in int16 (<= 12288) before vpmaddwd with ones widens them into the int32 sums.
// The offset comes back as in the VNNI kernel: each group's int32 accumulators start at
// -off * sum_g a, from the `qs8rs` row sums of the packed A.
// 8-bit codes (int8_affine, codes8): u = c = v + 128 (off 128) would saturate vpmaddubsw (a pair
// reaches 2 * 255 * 128), so each code byte is split into its nibbles, u = 16 h + l (and; shift +
// and), and both run against the same A word: two vpmaddubsw per row and 4 k, each exact (a pair
// <= 2 * 15 * 128 = 3840) and summed in int16 over 32 k (8 * 3840 = 30720 < 2^15, A anywhere in
// int8), then widened as l_sum * 1 + h_sum * 16 (two vpmaddwd) into the int32 sums, which start at
// -128 * sum_g a. (The sign trick, vpmaddubsw(|v|, sign(a, v)), would need no split, but it is
// wrong for a = -128, which pack_lhs takes like any int8.)
//
// Layouts:
//   A (`qs8rs`, Q4LhsRowSums): row i at i * (kp + kp / 8): kp = round_up(k, 32) int8, then kp / 32
//      int32 sums of 32-k slices.
//   B (`q4ci8x8`, Q4Packing<8, 1, ByteSlices4>, nibbles by NibbleSlices8<8>): blocks of 8
//      columns; per group, per 8 k, 32 bytes: byte 4c + t = column c's k 8s + t (low nibble) and
//      8s + 4 + t (high nibble); then the group's 8 scales (fp32 for int4, E8M0 bytes for mxfp4,
//      decoded here). int8_affine (ByteSlices4): per group, per 4 k, 32 bytes: byte 4c + t =
//      column c's code of k 4s + t as given; then the group's 8 fp32 scales.
// Loop: per column step (4 blocks = 32 columns for one row, else 1 block) and row tile (up to 4
// rows, split evenly), per group: per 8 k and block, one 32-byte load decoded into two
// ymm (and, shift + and, two vpshufb), then per row two vpmaddubsw with the row's two 4-byte A
// words broadcast, vpaddw, vpmaddwd, vpaddd; at the group end cvt, mul by the group scales and add
// into the fp32 accumulators (the order of q4gemm.h: no FMA). The int32 accumulators (<= 8 ymm)
// stay in registers; the fp32 ones, touched once per group, live in L1 (16 ymm are too few for
// both; with lhs_group_scale, one more mul by the row's group scale). Epilogue: * lhs_scale, +
// bias, vpmaskmov at the tail (nothing past n is written).
// 8-bit codes: per 32 k, per 4 k (unrolled) and block, one 32-byte load split into two ymm
// (and, shift + and), then per row two vpmaddubsw with the row's 4-byte A word broadcast and two
// vpaddw into the int16 sums (2 per row and block, 8 ymm at 4 x 1 and 1 x 4, in registers); every
// 32 k two vpmaddwd and vpaddd into the int32 sums, which join the int4 path at the group end.
// With one row (decode) the next column step's lines are prefetched into L2 as well (as the
// qgemm AVX2 kernel's walk does): 15% less time per call there.
// Features used: AVX2 (FMA is part of the level's contract, not used here).
#if !defined(__x86_64__) || !defined(__AVX2__)
#error "q4gemm_qs8rs_q4ci8x8_4x8_avx2.cpp needs -mavx2 -mfma (set per file by CMake)"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpumoe/q4gemm.h"
#include "ukernels/common/x86/avx2_common.h"
#include "ukernels/q4gemm/x86/q4gemm_x86_common.h"

namespace cpumoe {
namespace {

constexpr int64_t kMr = 4;
constexpr int64_t kNr = 8;
// int8_affine's 8-bit codes: per 4 k (slice s of the group), 32 bytes, byte 4c + t holding
// column c's code of k 4s + t as it is (0..255): one load is the qgemm `qs8ci8x4` shape.
struct ByteSlices4 {
  static int64_t index(int64_t c, int64_t kk, int64_t /*g*/) {
    return (kk / 4) * 4 * kNr + 4 * c + kk % 4;
  }
  static uint8_t code(uint8_t c) { return c; }
};
using Packing = Q4Packing<kNr, 1, ByteSlices4>;
using Arrange = NibbleSlices8<kNr>;
constexpr int64_t kSliceBytes = 4 * kNr;  // 8 k (nibbles) or 4 k (8-bit codes) of one block
// One row: 4 blocks per step (4 weight streams, 4 int32 accumulators); more: one block, up to 4
// rows. A decoded vector feeds every row of the tile, and the row's two broadcast A words every
// block of it: with 2 blocks x 4 rows, the 8 accumulators, 8 broadcasts, 2 decoded vectors and 3
// constants exceed the 16 ymm and GCC keeps the accumulators on the stack (measured: load, add
// and store per multiply-add).
constexpr int kSmallRows = 1, kSmallBlocks = 4, kRows = 4, kBlocks = 1;
constexpr int64_t kPrefetch = 512;  // bytes ahead in each block's stream

// What stays in registers over the call: the nibble mask, the unsigned decode table, int16 ones.
struct Decode {
  __m256i mask, table, ones;
  int32_t offset;
  explicit Decode(W4Format f) {
    // int8_affine: no table (the codes' nibbles are their own unsigned values), offset 128.
    const int8_t* t = w4_decode_table(f);
    offset = f == W4Format::int8_affine ? 128 : f == W4Format::mxfp4 ? 12 : 8;
    alignas(16) int8_t u[16] = {};
    for (int c = 0; t != nullptr && c < 16; ++c) u[c] = int8_t(t[c] + offset);
    mask = _mm256_set1_epi8(0x0f);
    table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(u)));
    ones = _mm256_set1_epi16(1);
  }
  // 32 code bytes -> the unsigned values of k 0..3 (lo) and 4..7 (hi) of 8 columns.
  void operator()(const uint8_t* p, __m256i& lo, __m256i& hi) const {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_shuffle_epi8(table, _mm256_and_si256(x, mask));
    hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(x, 4), mask));
  }
};

// The 8 fp32 scales of one group of a block (at p, after its codes).
template <bool Mx>
inline __m256 load_scales(const uint8_t* p) {
  if constexpr (!Mx) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else {
    // E8M0 e -> 2^(e - 128) as w4_mxfp4_scale: (e - 1) << 23, e = 0, 1 subnormal, 255 NaN.
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    __m256i bits = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    bits = _mm256_blendv_epi8(bits, _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e),
                              _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000),
                              _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255)));
    return _mm256_castsi256_ps(bits);
  }
}

inline __m256i bcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);  // vpbroadcastd from memory: a load, no shuffle
}

// The kernel as run_q4_f32 (q4gemm_x86_common.h) takes it: the walk's steps and the tile.
struct Kernel : Q4X86Steps<Packing, kSmallRows, kSmallBlocks, kSmallRows, kSmallBlocks, kRows,
                           kBlocks, Decode> {
  template <int MR, int NB, Q4Codes C, int G>
  static void tile(const Q4Call<Decode>& c, int64_t i0, int64_t jb);
};

// Rows [i0, i0 + MR) of A x blocks [jb, jb + NB) of B (block b at bp + b * bstride).
// G: the group size when known at compile time (run_q4_f32's list: the slice loop's count and
// the row sums fixed), else 0 (w.group).
template <int MR, int NB, Q4Codes C, int G>
void Kernel::tile(const Q4Call<Decode>& c, int64_t i0, int64_t jb) {
  const auto [a, bp, lda, bstride, g, groups, gbytes, cbytes] = q4_tile_span<Packing, G>(c, i0, jb);
  constexpr bool Mx = C == Q4Codes::mxfp4;
  alignas(32) float acc[MR][NB][kNr] = {};
  __m256i isum[MR][NB];
  // Blocks of the next column step (8-bit codes, one row: prefetched).
  const int64_t next_blocks = std::min<int64_t>(NB, (c.n + kNr - 1) / kNr - jb - NB);
  for (int64_t gi = 0; gi < groups; ++gi) {
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const uint32_t sum = uint32_t(Q4LhsRowSums::group_sum(a + r * lda, c.kp, gi, g));
      const __m256i init = _mm256_set1_epi32(int32_t(0u - uint32_t(c.dec.offset) * sum));
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) isum[r][b] = init;
    }
    const uint8_t* grp = bp + gi * gbytes;
    const int8_t* ag = reinterpret_cast<const int8_t*>(a) + gi * g;
    if constexpr (C == Q4Codes::bytes) {
      // 8-bit codes u = v + 128 = 16 h + l: per 32 k, per 4-k slice and block, one load split
      // into its nibbles l and h (and; shift + and), two vpmaddubsw per row with the row's A word
      // broadcast, each summed over the 8 slices in int16 (8 * 2 * 15 * 128 = 30720 < 2^15, A
      // anywhere in int8), then widened as lsum * 1 + hsum * 16 (vpmaddwd) into the int32 sums.
      const __m256i sixteen = _mm256_set1_epi16(16);
      for (int64_t q = 0; q < g / 32; ++q) {
        __m256i lsum[MR][NB], hsum[MR][NB];
#pragma GCC unroll 8
        for (int s = 0; s < 8; ++s) {
#pragma GCC unroll 4
          for (int b = 0; b < NB; ++b) {
            const uint8_t* p = grp + b * bstride + (8 * q + s) * kSliceBytes;
            _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
            // One row: the next column step's line too, into L2 (as the qgemm AVX2 kernel's
            // decode walk): 150 vs 176 us per call at n 1536, k 2048, g 32, one thread (Zen 5;
            // T0 instead: 195 us).
            if (MR == 1 && s % 2 == 0 && b < next_blocks)
              _mm_prefetch(reinterpret_cast<const char*>(p + NB * bstride), _MM_HINT_T1);
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
            const __m256i lo = _mm256_and_si256(x, c.dec.mask);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), c.dec.mask);
#pragma GCC unroll 4
            for (int r = 0; r < MR; ++r) {
              const __m256i av = bcast(ag + r * lda + 32 * q + 4 * s);
              const __m256i pl = _mm256_maddubs_epi16(lo, av);
              const __m256i ph = _mm256_maddubs_epi16(hi, av);
              lsum[r][b] = s == 0 ? pl : _mm256_add_epi16(lsum[r][b], pl);
              hsum[r][b] = s == 0 ? ph : _mm256_add_epi16(hsum[r][b], ph);
              // In order: else GCC reassociates the 8 adds into a tree and keeps all the
              // products live (on the stack); a loop over s instead keeps an accumulator there.
              asm("" : "+x"(lsum[r][b]), "+x"(hsum[r][b]));
            }
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
          for (int b = 0; b < NB; ++b)
            isum[r][b] = _mm256_add_epi32(
                isum[r][b], _mm256_add_epi32(_mm256_madd_epi16(lsum[r][b], c.dec.ones),
                                             _mm256_madd_epi16(hsum[r][b], sixteen)));
      }
    } else {
      // With 2+ rows, two 8-k slices are summed in int16 before one vpmaddwd widens them: 4 pairs
      // of at most 2 * 24 * 127 = 6096 each, 24384 < 2^15 (g / 8 is even: g is a multiple of 32).
      // One row keeps one slice per step: measured faster there (decode reads, little to save).
      constexpr int kStep = MR >= 2 ? 2 : 1;
      for (int64_t s = 0; s < g / 8; s += kStep) {
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) {
          const uint8_t* p = grp + b * bstride + s * kSliceBytes;
          _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
          __m256i lo0, hi0;
          c.dec(p, lo0, hi0);
          if constexpr (kStep == 2) {
            __m256i lo1, hi1;
            c.dec(p + kSliceBytes, lo1, hi1);
#pragma GCC unroll 4
            for (int r = 0; r < MR; ++r) {
              const int8_t* ar = ag + r * lda + 8 * s;
              const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, bcast(ar)),
                                                  _mm256_maddubs_epi16(hi0, bcast(ar + 4)));
              const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, bcast(ar + 8)),
                                                  _mm256_maddubs_epi16(hi1, bcast(ar + 12)));
              isum[r][b] = _mm256_add_epi32(
                  isum[r][b], _mm256_madd_epi16(_mm256_add_epi16(p0, p1), c.dec.ones));
            }
          } else {
            const int8_t* ar = ag + 8 * s;
            const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, bcast(ar)),
                                                _mm256_maddubs_epi16(hi0, bcast(ar + 4)));
            isum[0][b] = _mm256_add_epi32(isum[0][b], _mm256_madd_epi16(p0, c.dec.ones));
          }
        }
      }
    }
    const float* gs = c.ep.lhs_group_scale;  // per row and group, or none
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const __m256 sc = load_scales<Mx>(grp + b * bstride + cbytes);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[r][b]), sc);
        if (gs) f = _mm256_mul_ps(f, _mm256_set1_ps(gs[(i0 + r) * groups + gi]));
        _mm256_store_ps(acc[r][b], _mm256_add_ps(_mm256_load_ps(acc[r][b]), f));
      }
    }
  }
  const StoreF32Acc store{c.dst, c.ld, c.ep.bias};
  for (int b = 0; b < NB; ++b) {
    const int64_t c0 = jb * kNr + kNr * b;
    const int64_t nc = std::min<int64_t>(kNr, c.n - c0);
    for (int r = 0; r < MR; ++r)
      store(i0 + r, c0, nc,
            _mm256_mul_ps(_mm256_load_ps(acc[r][b]), _mm256_set1_ps(c.ep.lhs_scale[i0 + r])));
  }
}

}  // namespace

extern const Q4GemmUkernel q4gemm_qs8rs_q4ci8x8_4x8_avx2 = make_q4gemm<Q4LhsRowSums, Packing>(
    "q4gemm_qs8rs_q4ci8x8_4x8_avx2", Isa::avx2, kMr, pack_lhs_qs8rs,
    pack_rhs_q4<Packing, Arrange>, run_q4_f32<Kernel>);

}  // namespace cpumoe
