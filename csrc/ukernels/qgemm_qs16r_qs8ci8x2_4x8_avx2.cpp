// qgemm_qs16r_qs8ci8x2_4x8_avx2: the int8 GEMM on AVX2 (Haswell and later, no VNNI needed).
//
// vpmaddubsw (u8 x s8 pairs into int16) saturates: with a shifted activation in [0, 255] and a
// weight of -128, two products already reach -65280. So this kernel stays in int16 x int16:
// activations are sign-extended to int16 once, at packing (they are small), weights stay int8 in
// memory (decode streams them) and are sign-extended on load (vpmovsxbw m128, one shuffle per 16
// bytes), and vpmaddwd adds each pair of int16 products into int32: |pair| <= 2 * 128 * 128, exact.
// The int32 accumulation wraps like the true sum's two's complement, so C is bit-exact for every
// int8 A and B.
//
// Layouts (kp = round_up(k, 8), so that a B block is a multiple of 64 bytes):
//   A (`qs16r`): row i at i * 2 * kp bytes, kp int16 (padding 0).
//   B (`qs8ci8x2`): block b of 8 output columns at b * 8 * kp: kp / 2 groups of 16 bytes, group g
//      holding column c's k = 2g, 2g+1 at bytes 2c, 2c+1 (vpmovsxbw makes the 16 int16 that one
//      vpmaddwd with the broadcast A pair (a[2g], a[2g+1]) turns into 8 column sums).
// Register tile (16 ymm): up to 4 rows x 2 blocks (16 columns, 8 accumulators), or for 1-2 rows
// (decode) 2 x 4 blocks (32 columns: four weight streams per row), the whole K in registers.
// Column tails use vpmaskmov stores (nothing past n is written).
// Features used: AVX2 (FMA is part of the level's contract, not used here).
#if !defined(__x86_64__) || !defined(__AVX2__)
#error "qgemm_qs16r_qs8ci8x2_4x8_avx2.cpp needs -mavx2 -mfma (set per file by CMake)"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpumoe/qgemm.h"
#include "ukernels/qgemm_common.h"

namespace cpumoe {
namespace {

constexpr int64_t kMr = 4;
constexpr int64_t kNr = 8;
constexpr int64_t kKr = 8;

inline int64_t padded_k(int64_t k) { return round_up(k, kKr); }

size_t lhs_size(int64_t m, int64_t k) { return size_t(m) * size_t(padded_k(k)) * 2; }
size_t lhs_offset(int64_t m_idx, int64_t k) { return size_t(m_idx) * size_t(padded_k(k)) * 2; }

void pack_lhs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  const int64_t kp = padded_k(k);
  auto* dst = static_cast<int16_t*>(packed);
  for (int64_t i = 0; i < m; ++i) {
    const int8_t* r = rows[i];
    int16_t* d = dst + i * kp;
    int64_t x = 0;
    for (; x + 16 <= k; x += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + x),
                          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + x))));
    for (; x < k; ++x) d[x] = r[x];
    for (; x < kp; ++x) d[x] = 0;
  }
}

size_t rhs_size(int64_t n, int64_t k) { return size_t(round_up(n, kNr)) * size_t(padded_k(k)); }
size_t rhs_offset(int64_t n_idx, int64_t k) { return size_t(n_idx / kNr * kNr) * size_t(padded_k(k)); }

void pack_rhs(int64_t n, int64_t k, const int8_t* rhs, int64_t stride, void* packed) {
  const int64_t kp = padded_k(k);
  auto* dst = static_cast<int8_t*>(packed);
  const int64_t blocks = (n + kNr - 1) / kNr;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    int8_t* d = dst + blk * kNr * kp;
    for (int64_t c = 0; c < kNr; ++c) {
      const int64_t j = blk * kNr + c;
      const int8_t* src = j < n ? rhs + j * stride : nullptr;
      for (int64_t x = 0; x < kp; x += 2) {
        int8_t* p = d + 8 * x + 2 * c;  // group x / 2 at 16 * (x / 2)
        p[0] = src != nullptr && x < k ? src[x] : int8_t(0);
        p[1] = src != nullptr && x + 1 < k ? src[x + 1] : int8_t(0);
      }
    }
  }
}

inline int32_t load_pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline __m256i lane_mask(int64_t nc) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(nc)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

struct StoreS32 {
  int32_t* dst;
  int64_t ld;
  void operator()(int64_t i, int64_t j0, int64_t nc, __m256i v) const {
    int32_t* d = dst + i * ld + j0;
    if (nc >= 8) _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), v);
    else _mm256_maskstore_epi32(d, lane_mask(nc), v);
  }
};

struct StoreF32 {
  float* dst;
  int64_t ld;
  const QGemmEpilogue* ep;
  void operator()(int64_t i, int64_t j0, int64_t nc, __m256i v) const {
    float* d = dst + i * ld + j0;
    __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(ep->lhs_scale[i]));
    if (nc >= 8) {
      f = _mm256_mul_ps(f, _mm256_loadu_ps(ep->rhs_scale + j0));
      if (ep->bias != nullptr) f = _mm256_add_ps(f, _mm256_loadu_ps(ep->bias + j0));
      _mm256_storeu_ps(d, f);
    } else {
      const __m256i mk = lane_mask(nc);
      f = _mm256_mul_ps(f, _mm256_maskload_ps(ep->rhs_scale + j0, mk));
      if (ep->bias != nullptr) f = _mm256_add_ps(f, _mm256_maskload_ps(ep->bias + j0, mk));
      _mm256_maskstore_ps(d, mk, f);
    }
  }
};

// MR rows x NB blocks over the whole (padded) depth. The accumulators are named variables, not an
// array (GCC keeps arrays of vectors partly in memory); `if constexpr` drops the unused ones. They
// go through L1 to the epilogue, which keeps GCC 12 from copying them to the stack in the loop.
#define CPUMOE_ACC_DECL(i) \
  __m256i c##i##0 = _mm256_setzero_si256(), c##i##1 = c##i##0, c##i##2 = c##i##0, c##i##3 = c##i##0;
#define CPUMOE_ACC_ROW(i)                                                                  \
  if constexpr (MR > i) {                                                                  \
    const __m256i av = _mm256_set1_epi32(load_pair(a + i * kp + 2 * g));                  \
    c##i##0 = _mm256_add_epi32(c##i##0, _mm256_madd_epi16(av, b0));                        \
    if constexpr (NB > 1) c##i##1 = _mm256_add_epi32(c##i##1, _mm256_madd_epi16(av, b1)); \
    if constexpr (NB > 2) c##i##2 = _mm256_add_epi32(c##i##2, _mm256_madd_epi16(av, b2)); \
    if constexpr (NB > 3) c##i##3 = _mm256_add_epi32(c##i##3, _mm256_madd_epi16(av, b3)); \
  }
#define CPUMOE_ACC_SPILL(i)                                                   \
  if constexpr (MR > i) {                                                     \
    _mm256_store_si256(buf + i * NB, c##i##0);                                \
    if constexpr (NB > 1) _mm256_store_si256(buf + i * NB + 1, c##i##1);      \
    if constexpr (NB > 2) _mm256_store_si256(buf + i * NB + 2, c##i##2);      \
    if constexpr (NB > 3) _mm256_store_si256(buf + i * NB + 3, c##i##3);      \
  }

inline __m256i load_b(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Rows [i0, i0 + MR) x columns [j0, j0 + 8 * NB) (clipped to n), stored through `store`.
template <int MR, int NB, class Store>
inline void tile_store(int64_t i0, int64_t j0, int64_t n, const int16_t* a, int64_t kp,
                       const int8_t* b, int64_t bstride, const Store& store) {
  static_assert(MR >= 1 && MR <= 4 && NB >= 1 && NB <= 4 && MR * NB <= 8, "tile too large");
  CPUMOE_ACC_DECL(0) CPUMOE_ACC_DECL(1) CPUMOE_ACC_DECL(2) CPUMOE_ACC_DECL(3)
  const int64_t groups = kp / 2;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i b0 = load_b(b + 16 * g), b1 = b0, b2 = b0, b3 = b0;
    if constexpr (NB > 1) b1 = load_b(b + bstride + 16 * g);
    if constexpr (NB > 2) b2 = load_b(b + 2 * bstride + 16 * g);
    if constexpr (NB > 3) b3 = load_b(b + 3 * bstride + 16 * g);
    CPUMOE_ACC_ROW(0) CPUMOE_ACC_ROW(1) CPUMOE_ACC_ROW(2) CPUMOE_ACC_ROW(3)
  }
  alignas(32) __m256i buf[MR * NB];
  CPUMOE_ACC_SPILL(0) CPUMOE_ACC_SPILL(1) CPUMOE_ACC_SPILL(2) CPUMOE_ACC_SPILL(3)
  for (int j = 0; j < NB; ++j) {
    const int64_t c0 = j0 + kNr * j;
    const int64_t nc = std::min<int64_t>(kNr, n - c0);
    for (int i = 0; i < MR; ++i) store(i0 + i, c0, nc, _mm256_load_si256(buf + i * NB + j));
  }
}
#undef CPUMOE_ACC_DECL
#undef CPUMOE_ACC_ROW
#undef CPUMOE_ACC_SPILL

template <class Store>
void run(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, const Store& store) {
  if (m <= 0 || n <= 0) return;
  const int64_t kp = padded_k(k);
  const auto* a = static_cast<const int16_t*>(lhs);
  const auto* b = static_cast<const int8_t*>(rhs);
  const int64_t bstride = kNr * kp;
  const int64_t blocks = (n + kNr - 1) / kNr;
  // 1-2 rows: 32-column steps, else 16-column steps with row tiles of 4.
  const bool small = m <= 2;
  const int64_t step_blocks = small ? 4 : 2;
  const int64_t max_rows = small ? 2 : kMr;
  for (int64_t jb = 0; jb < blocks; jb += step_blocks) {
    const int64_t nb = std::min(step_blocks, blocks - jb);
    const int8_t* bj = b + jb * bstride;
    const int64_t j0 = jb * kNr;
    for (int64_t i0 = 0; i0 < m; i0 += max_rows) {
      const int64_t rows = std::min(max_rows, m - i0);
      const int16_t* ai = a + i0 * kp;
#define CPUMOE_TILE(R, B) \
  case R * 8 + B: tile_store<R, B>(i0, j0, n, ai, kp, bj, bstride, store); break;
      switch (rows * 8 + nb) {
        CPUMOE_TILE(1, 1) CPUMOE_TILE(1, 2) CPUMOE_TILE(1, 3) CPUMOE_TILE(1, 4)
        CPUMOE_TILE(2, 1) CPUMOE_TILE(2, 2) CPUMOE_TILE(2, 3) CPUMOE_TILE(2, 4)
        CPUMOE_TILE(3, 1) CPUMOE_TILE(3, 2)
        CPUMOE_TILE(4, 1) CPUMOE_TILE(4, 2)
        default: break;  // unreachable: rows <= max_rows, nb <= step_blocks
      }
#undef CPUMOE_TILE
    }
  }
}

void run_s32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, int32_t* dst,
             int64_t dst_stride) {
  run(m, n, k, lhs, rhs, StoreS32{dst, dst_stride});
}

void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  run(m, n, k, lhs, rhs, StoreF32{dst, dst_stride, &ep});
}

}  // namespace

extern const QGemmUkernel qgemm_qs16r_qs8ci8x2_4x8_avx2 = {
    "qgemm_qs16r_qs8ci8x2_4x8_avx2",
    Isa::avx2,
    kMr,
    kNr,
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
