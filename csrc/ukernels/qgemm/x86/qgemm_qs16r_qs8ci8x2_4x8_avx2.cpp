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
// Register tile (16 ymm; the walk of gemm_tile.h): up to 4 rows x 2 blocks (16 columns, 8
// accumulators), or for 1-2 rows (decode) 2 x 4 blocks (32 columns: four weight streams per row),
// the whole K in registers.
// Column tails use vpmaskmov stores (nothing past n is written).
// Features used: AVX2 (FMA is part of the level's contract, not used here).
#if !defined(__x86_64__) || !defined(__AVX2__)
#error "qgemm_qs16r_qs8ci8x2_4x8_avx2.cpp needs -mavx2 -mfma (set per file by CMake)"
#endif

#include <immintrin.h>

#include "cpumoe/qgemm.h"
#include "ukernels/common/gemm_tile.h"
#include "ukernels/common/x86/avx2_common.h"
#include "ukernels/qgemm/qgemm_common.h"

namespace cpumoe {
namespace {

constexpr int64_t kMr = 4;
using Packing = QGemmPacking<8, 8, 2>;  // A widened to int16
constexpr int64_t kNr = Packing::kNr;

void pack_lhs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  const int64_t kp = Packing::padded_k(k);
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

void pack_rhs(int64_t n, int64_t k, const int8_t* rhs, int64_t stride, void* packed) {
  const int64_t kp = Packing::padded_k(k);
  gemm_tile::pack_rhs_groups<int8_t, 2>(n, k, kp, kNr, rhs, stride, static_cast<int8_t*>(packed),
                                        kNr * kp);
}

// The arithmetic for gemm_tile.h: one group is 2 k, the broadcast A pair against the 16 bytes of
// B sign-extended to int16 (vpmaddwd, then vpaddd into the accumulator).
struct Ops {
  using Acc = __m256i;
  static constexpr int64_t kNr = 8;
  static constexpr int kSteps = 1;
  static constexpr int64_t kAGroupBytes = 4, kBGroupBytes = 16;
  // 1-2 rows: 32-column steps, else 16-column steps with row tiles of 4 (16 ymm in all).
  static constexpr int kSmallRows = 2, kSmallBlocks = 4, kRows = 4, kBlocks = 2;
  static constexpr bool kDecodePrefetch = true;  // gemm_tile.h run(): measured at T = 1
  static Acc zero() { return _mm256_setzero_si256(); }
  template <int S>
  static __m256i load_a(const uint8_t* p) { return _mm256_set1_epi32(gemm_tile::load_i32(p)); }
  template <int S>
  static __m256i load_b(const uint8_t* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static Acc dot(Acc c, __m256i a, __m256i b) {
    return _mm256_add_epi32(c, _mm256_madd_epi16(a, b));
  }
  static Acc finish(Acc c, const uint8_t*) { return c; }
};

template <class Store>
void run(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, const Store& store) {
  const int64_t kp = Packing::padded_k(k);
  gemm_tile::run<Ops>(m, n, static_cast<const uint8_t*>(lhs), 2 * kp,
                      static_cast<const uint8_t*>(rhs), kNr * kp, kp / 2, store);
}

void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  run(m, n, k, lhs, rhs, StoreF32{dst, dst_stride, &ep});
}

}  // namespace

extern const QGemmUkernel qgemm_qs16r_qs8ci8x2_4x8_avx2 = make_qgemm<Packing>(
    "qgemm_qs16r_qs8ci8x2_4x8_avx2", Isa::avx2, kMr, pack_lhs, pack_rhs, run_f32);

}  // namespace cpumoe
