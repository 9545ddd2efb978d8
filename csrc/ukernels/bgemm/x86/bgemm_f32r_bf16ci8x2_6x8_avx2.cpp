// bgemm_f32r_bf16ci8x2_6x8_avx2: the bf16 GEMM on AVX2 + FMA (Haswell and later, no AVX-512).
//
// bf16 is the upper half of an fp32, so widening is a 16-bit shift: B stays bf16 in memory (decode
// streams it) and is widened in registers, A (small) is widened once, at packing.
//
// Layouts (kp = round_up(k, 4), so that a B block is a multiple of 64 bytes):
//   A (`f32r`): row i at i * kp floats (padding 0).
//   B (`bf16ci8x2`): block b of 8 output columns at b * 8 * kp bf16: kp / 2 groups of 32 bytes,
//      group g holding column c's k = 2g, 2g+1 at bf16 2c, 2c+1. One ymm load of a group gives
//      both k of the 8 columns: shifted left by 16 it is k = 2g in fp32, shifted right and back
//      left (its lower halves cleared) it is k = 2g+1.
// Register tile (16 ymm; the walk of gemm_tile.h): up to 6 rows x 2 blocks (16 columns, 12
// accumulators), or for 1-2 rows (decode) 2 x 4 blocks (32 columns: four weight streams), the
// whole K in registers. A group is two sub-steps, k = 2g for every row, then k = 2g+1 (the group
// is loaded again from L1), so one widened B vector per block is live at a time: 12 accumulators,
// 2 B and 1 broadcast A of the 16 ymm. Per group of a 6 x 2 tile: 4 B loads, 12 broadcasts, 6
// shifts and 24 FMAs (on Haswell the shifts share port 0 with the FMAs). Each accumulator sums
// its products in k order with one FMA each; a product of two bf16 is exact in fp32 (unless it
// underflows), so the result is the same, bit for bit, as the portable kernel's multiply-then-add.
// Column tails use vmaskmovps stores (nothing past n is written).
// Features used: AVX2, FMA.
#if !defined(__x86_64__) || !defined(__AVX2__) || !defined(__FMA__)
#error "bgemm_f32r_bf16ci8x2_6x8_avx2.cpp needs -mavx2 -mfma (set per file by CMake)"
#endif

#include <immintrin.h>

#include "ukernels/bgemm/bgemm_common.h"
#include "ukernels/common/gemm_tile.h"
#include "ukernels/common/x86/avx2_common.h"

namespace cpumoe {
namespace {

using Packing = BGemmPacking</*Nr=*/8, /*Kr=*/4, /*LhsBytes=*/4>;

// The arithmetic for gemm_tile.h: sub-step S of group g is k = 2g + S, the broadcast fp32 A value
// times the widened B vector.
struct Ops {
  using Acc = __m256;
  static constexpr int64_t kNr = Packing::kNr;
  static constexpr int kSteps = 2;
  static constexpr int64_t kAGroupBytes = 8, kBGroupBytes = 32;
  static constexpr int kSmallRows = 2, kSmallBlocks = 4, kRows = 6, kBlocks = 2;
  static constexpr bool kDecodePrefetch = true;  // gemm_tile.h run(): measured at T = 1
  static Acc zero() { return _mm256_setzero_ps(); }
  template <int S>
  static __m256 load_a(const uint8_t* p) {
    return _mm256_broadcast_ss(reinterpret_cast<const float*>(p) + S);
  }
  template <int S>
  static __m256 load_b(const uint8_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (S == 0) return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    // Shifted down and up rather than masked: a mask would be a 17th live ymm of the 6 x 2 tile,
    // and GCC 12 then spills accumulators inside the loop (24-31% slower on Zen 4, m = 16, 128).
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(v, 16), 16));
  }
  static Acc dot(Acc c, __m256 a, __m256 b) { return _mm256_fmadd_ps(a, b, c); }
  static Acc finish(Acc c, const uint8_t*) { return c; }
};

}  // namespace

extern const BGemmUkernel bgemm_f32r_bf16ci8x2_6x8_avx2 = make_bgemm<Packing>(
    "bgemm_f32r_bf16ci8x2_6x8_avx2", Isa::avx2, /*mr=*/6, pack_lhs_f32r<Packing>,
    pack_rhs_bf16c<Packing, 2>, run_f32_tiles<Ops, Packing, StoreF32Acc>);

}  // namespace cpumoe
