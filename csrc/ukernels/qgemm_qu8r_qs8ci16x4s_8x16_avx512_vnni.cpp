// qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni: the int8 GEMM on AVX-512 VNNI (vpdpbusd).
//
// vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products to an int32 lane,
// 16 lanes per zmm. A is therefore shifted to unsigned at packing, u = a + 128, and the shift is
// taken back with column sums precomputed at prepack:
//   sum_k (a + 128) * b = sum_k a * b + 128 * sum_k b,  so  C = acc - 128 * colsum(B).
// Both sides are exact in int32 (vpdpbusd wraps, it does not saturate, and the true result fits),
// so the kernel is bit-exact for every int8 A and B.
//
// Layouts (kp = round_up(k, 4)):
//   A (`qu8r`): row i at i * kp, kp bytes of a + 128 (uint8); padding bytes are 128 (a = 0).
//   B (`qs8ci16x4s`): block b of 16 output columns at b * (16 * kp + 64): kp / 4 groups of 64
//      bytes, group g holding column c's k = 4g .. 4g+3 at bytes 4c .. 4c+3 (one zmm, one
//      vpdpbusd covers 16 columns x 4 k), then 16 int32: 128 * sum_k B[c][k]. Padding columns
//      and padding k are zero (so are their sums).
// Register tile: up to 8 rows x 3 blocks (48 columns, 24 zmm accumulators) or up to 6 rows x 4
// blocks (64 columns), the whole K in registers: per 4 k, NB zmm loads of B and one 4-byte
// broadcast of A per row feed MR * NB vpdpbusd. Small M (decode: one row per expert) runs 1 x 64
// columns: four independent weight streams, read once, at memory bandwidth; the column tile of
// the call is walked in 64- or 48-column steps with the rows inner, so a step's weights stay in
// L1/L2 while the row tiles pass. Column tails are masked stores (nothing past n is written).
// The name's 8x16 is mr x nr (rows of the main tile x columns of one packed block).
// Features used: AVX-512 F, BW, VL, VNNI.
#if !defined(__x86_64__) || !defined(__AVX512F__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni.cpp needs -mavx512f -mavx512bw -mavx512vl -mavx512vnni (set per file by CMake)"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpumoe/qgemm.h"
#include "ukernels/qgemm_common.h"
#include "ukernels/qgemm_avx512_common.h"
#include "ukernels/qgemm_x86_vnni.h"

namespace cpumoe {
namespace x86_vnni {
namespace {

constexpr int64_t kNr = 16;

inline __mmask64 mask64(int64_t n) {
  return n >= 64 ? __mmask64(~0ULL) : __mmask64((1ULL << n) - 1);
}
inline int32_t load_u32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// MR rows x NB blocks over the whole (padded) depth. The accumulators are named variables, not an
// array: GCC keeps an array of zmm partly in memory (a store per vpdpbusd), named ones stay in
// registers; the `if constexpr` guards drop the ones a tile does not use.
#define CPUMOE_ACC_DECL(i) \
  __m512i c##i##0 = _mm512_setzero_si512(), c##i##1 = c##i##0, c##i##2 = c##i##0, c##i##3 = c##i##0;
#define CPUMOE_ACC_ROW(i)                                                       \
  if constexpr (MR > i) {                                                       \
    const __m512i av = _mm512_set1_epi32(load_u32(a + i * kp + 4 * g));        \
    c##i##0 = _mm512_dpbusd_epi32(c##i##0, av, b0);                             \
    if constexpr (NB > 1) c##i##1 = _mm512_dpbusd_epi32(c##i##1, av, b1);       \
    if constexpr (NB > 2) c##i##2 = _mm512_dpbusd_epi32(c##i##2, av, b2);       \
    if constexpr (NB > 3) c##i##3 = _mm512_dpbusd_epi32(c##i##3, av, b3);       \
  }
#define CPUMOE_ACC_SPILL(i)                                                     \
  if constexpr (MR > i) {                                                       \
    _mm512_store_si512(buf + (i * NB) * 16, c##i##0);                           \
    if constexpr (NB > 1) _mm512_store_si512(buf + (i * NB + 1) * 16, c##i##1); \
    if constexpr (NB > 2) _mm512_store_si512(buf + (i * NB + 2) * 16, c##i##2); \
    if constexpr (NB > 3) _mm512_store_si512(buf + (i * NB + 3) * 16, c##i##3); \
  }

// Rows [i0, i0 + MR) x columns [j0, j0 + 16 * NB) (clipped to n), stored through `store`.
template <int MR, int NB, class Store>
inline void tile_store(int64_t i0, int64_t j0, int64_t n, const uint8_t* a, int64_t kp,
                       const int8_t* b, int64_t bstride, const Store& store) {
  static_assert(MR >= 1 && MR <= 8 && NB >= 1 && NB <= 4 && MR * NB <= 24, "tile too large");
  CPUMOE_ACC_DECL(0) CPUMOE_ACC_DECL(1) CPUMOE_ACC_DECL(2) CPUMOE_ACC_DECL(3)
  CPUMOE_ACC_DECL(4) CPUMOE_ACC_DECL(5) CPUMOE_ACC_DECL(6) CPUMOE_ACC_DECL(7)
  const int64_t groups = kp / 4;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i b0 = _mm512_loadu_si512(b + 64 * g), b1 = b0, b2 = b0, b3 = b0;
    if constexpr (NB > 1) b1 = _mm512_loadu_si512(b + bstride + 64 * g);
    if constexpr (NB > 2) b2 = _mm512_loadu_si512(b + 2 * bstride + 64 * g);
    if constexpr (NB > 3) b3 = _mm512_loadu_si512(b + 3 * bstride + 64 * g);
    CPUMOE_ACC_ROW(0) CPUMOE_ACC_ROW(1) CPUMOE_ACC_ROW(2) CPUMOE_ACC_ROW(3)
    CPUMOE_ACC_ROW(4) CPUMOE_ACC_ROW(5) CPUMOE_ACC_ROW(6) CPUMOE_ACC_ROW(7)
  }
  // Through L1 to the epilogue: with the epilogue reading the registers directly, GCC 12 keeps a
  // stack copy of every accumulator updated inside the loop.
  alignas(64) int32_t buf[MR * NB * 16];
  CPUMOE_ACC_SPILL(0) CPUMOE_ACC_SPILL(1) CPUMOE_ACC_SPILL(2) CPUMOE_ACC_SPILL(3)
  CPUMOE_ACC_SPILL(4) CPUMOE_ACC_SPILL(5) CPUMOE_ACC_SPILL(6) CPUMOE_ACC_SPILL(7)
  for (int j = 0; j < NB; ++j) {
    // The column sums (128 * sum_k B) sit after each block's data.
    const __m512i sums = _mm512_loadu_si512(b + j * bstride + 16 * kp);
    const int64_t c0 = j0 + 16 * j;
    const int64_t nc = std::min<int64_t>(16, n - c0);
    for (int i = 0; i < MR; ++i)
      store(i0 + i, c0, nc, _mm512_sub_epi32(_mm512_load_si512(buf + (i * NB + j) * 16), sums));
  }
}
#undef CPUMOE_ACC_DECL
#undef CPUMOE_ACC_ROW
#undef CPUMOE_ACC_SPILL

template <int NB, class Store>
void rows_dispatch(int64_t rows, int64_t i0, int64_t j0, int64_t n, const uint8_t* a, int64_t kp,
                   const int8_t* b, int64_t bstride, const Store& s) {
  switch (rows) {
    case 1: tile_store<1, NB>(i0, j0, n, a, kp, b, bstride, s); break;
    case 2: tile_store<2, NB>(i0, j0, n, a, kp, b, bstride, s); break;
    case 3: tile_store<3, NB>(i0, j0, n, a, kp, b, bstride, s); break;
    case 4: tile_store<4, NB>(i0, j0, n, a, kp, b, bstride, s); break;
    case 5: tile_store<5, NB>(i0, j0, n, a, kp, b, bstride, s); break;
    case 6: tile_store<6, NB>(i0, j0, n, a, kp, b, bstride, s); break;
    case 7: if constexpr (NB <= 3) tile_store<7, NB>(i0, j0, n, a, kp, b, bstride, s); break;
    case 8: if constexpr (NB <= 3) tile_store<8, NB>(i0, j0, n, a, kp, b, bstride, s); break;
  }
}

template <class Store>
void run(int64_t m, int64_t n, int64_t kp, const void* lhs, const void* rhs, const Store& store) {
  if (m <= 0 || n <= 0) return;
  const auto* a = static_cast<const uint8_t*>(lhs);
  const auto* b = static_cast<const int8_t*>(rhs);
  const int64_t bstride = rhs_block_bytes(kp);
  // Up to 6 rows: 64-column steps and row tiles of <= 6; more rows: 48-column steps, tiles of 8.
  const int64_t max_rows = m <= 6 ? 6 : 8;
  const int64_t step_blocks = m <= 6 ? 4 : 3;
  const int64_t blocks = (n + kNr - 1) / kNr;
  for (int64_t jb = 0; jb < blocks; jb += step_blocks) {
    const int64_t nb = std::min(step_blocks, blocks - jb);
    const int8_t* bj = b + jb * bstride;
    const int64_t j0 = jb * kNr;
    for (int64_t i0 = 0; i0 < m; i0 += max_rows) {
      const int64_t rows = std::min(max_rows, m - i0);
      const uint8_t* ai = a + i0 * kp;
      switch (nb) {
        case 4: rows_dispatch<4>(rows, i0, j0, n, ai, kp, bj, bstride, store); break;
        case 3: rows_dispatch<3>(rows, i0, j0, n, ai, kp, bj, bstride, store); break;
        case 2: rows_dispatch<2>(rows, i0, j0, n, ai, kp, bj, bstride, store); break;
        default: rows_dispatch<1>(rows, i0, j0, n, ai, kp, bj, bstride, store); break;
      }
    }
  }
}

}  // namespace

void pack_lhs(int64_t m, int64_t k, int64_t kp, const int8_t* const* rows, void* packed) {
  auto* dst = static_cast<uint8_t*>(packed);
  const __m512i shift = _mm512_set1_epi8(char(0x80));
  for (int64_t i = 0; i < m; ++i) {
    const int8_t* r = rows[i];
    uint8_t* d = dst + i * kp;
    for (int64_t x = 0; x < kp; x += 64) {
      // Lanes past k load as 0 and store as 128 (a = 0); lanes past kp are not stored.
      const __m512i v = _mm512_maskz_loadu_epi8(mask64(k - x), r + x);
      _mm512_mask_storeu_epi8(d + x, mask64(kp - x), _mm512_xor_si512(v, shift));
    }
  }
}

void pack_rhs(int64_t n, int64_t k, int64_t kp, const int8_t* rhs, int64_t stride, void* packed) {
  auto* dst = static_cast<int8_t*>(packed);
  const int64_t bstride = rhs_block_bytes(kp);
  const int64_t blocks = (n + kNr - 1) / kNr;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    int8_t* d = dst + blk * bstride;
    int32_t sums[kNr];
    for (int64_t c = 0; c < kNr; ++c) {
      const int64_t j = blk * kNr + c;
      int32_t s = 0;
      if (j < n) {
        const int8_t* src = rhs + j * stride;
        int64_t x = 0;
        for (; x + 4 <= k; x += 4) std::memcpy(d + 16 * x + 4 * c, src + x, 4);
        if (x < k) {  // the last, partial group
          int8_t tail[4] = {0, 0, 0, 0};
          for (int64_t t = x; t < k; ++t) tail[t - x] = src[t];
          std::memcpy(d + 16 * x + 4 * c, tail, 4);
          x += 4;
        }
        for (; x < kp; x += 4) std::memset(d + 16 * x + 4 * c, 0, 4);  // padding groups (kp > k + 3)
        for (int64_t t = 0; t < k; ++t) s += src[t];
      } else {
        for (int64_t x = 0; x < kp; x += 4) std::memset(d + 16 * x + 4 * c, 0, 4);
      }
      // 128 * s: |s| <= 128 * k, so this fits int32 for k < 2^17; wraps consistently beyond.
      sums[c] = int32_t(uint32_t(s) * 128u);
    }
    std::memcpy(d + 16 * kp, sums, sizeof(sums));
  }
}

void run_s32(int64_t m, int64_t n, int64_t kp, const void* lhs, const void* rhs, int32_t* dst,
             int64_t dst_stride) {
  run(m, n, kp, lhs, rhs, StoreS32{dst, dst_stride});
}

void run_f32(int64_t m, int64_t n, int64_t kp, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  run(m, n, kp, lhs, rhs, StoreF32{dst, dst_stride, &ep});
}

}  // namespace x86_vnni

namespace {

constexpr int64_t kMr = 8;
constexpr int64_t kKr = 4;

inline int64_t padded_k(int64_t k) { return round_up(k, kKr); }

size_t lhs_size(int64_t m, int64_t k) { return size_t(m) * size_t(padded_k(k)); }
size_t lhs_offset(int64_t m_idx, int64_t k) { return size_t(m_idx) * size_t(padded_k(k)); }
void pack_lhs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  x86_vnni::pack_lhs(m, k, padded_k(k), rows, packed);
}
size_t rhs_size(int64_t n, int64_t k) {
  return size_t((n + x86_vnni::kBlockCols - 1) / x86_vnni::kBlockCols) *
         size_t(x86_vnni::rhs_block_bytes(padded_k(k)));
}
size_t rhs_offset(int64_t n_idx, int64_t k) {
  return size_t(n_idx / x86_vnni::kBlockCols) * size_t(x86_vnni::rhs_block_bytes(padded_k(k)));
}
void pack_rhs(int64_t n, int64_t k, const int8_t* rhs, int64_t stride, void* packed) {
  x86_vnni::pack_rhs(n, k, padded_k(k), rhs, stride, packed);
}
void run_s32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, int32_t* dst,
             int64_t dst_stride) {
  x86_vnni::run_s32(m, n, padded_k(k), lhs, rhs, dst, dst_stride);
}
void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  x86_vnni::run_f32(m, n, padded_k(k), lhs, rhs, dst, dst_stride, ep);
}

}  // namespace

extern const QGemmUkernel qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni = {
    "qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni",
    Isa::avx512_vnni,
    kMr,
    x86_vnni::kBlockCols,
    kKr,
    lhs_size,
    lhs_offset,
    pack_lhs,
    rhs_size,
    rhs_offset,
    pack_rhs,
    run_s32,
    run_f32,
};

}  // namespace cpumoe
