// f8gemm_f32r_f8ck16_6x16_avx2: the W8A16 FP8 GEMM (bf16 activations x E4M3 codes with fp32 block
// scales) on AVX2 + FMA + F16C (Haswell and later; the avx2 level's flags include -mf16c). The
// logic, layouts and arithmetic are f8gemm_x86.h's, on ymm: blocks of 16 columns (two ymm of fp32
// per row), per k 16 code bytes decoded at once (vpmovsxbw ymm with the load, vpsllw, vpand, then
// vcvtph2ps of each 128-bit half), the A value broadcast from memory.
// Tiles: 1 row by 4 blocks (64 columns: 4 weight streams, 8 accumulators), 2 rows by 2 blocks,
// else up to 6 rows by 1 block (12 accumulators; with the two weights, the decode temporary and
// the broadcast GCC 12 keeps a few of them on the stack, and still 6 rows beat 4 and 5: Zen 5,
// m = 24, 111 vs 99 and 106 GFLOP/s).
// Column tails are vmaskmovps stores (nothing past n is written); stream_dst is not used (the
// same values either way).
// Features used: AVX2, FMA, F16C.
#if !defined(__x86_64__) || !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "f8gemm_f32r_f8ck16_6x16_avx2.cpp needs -mavx2 -mfma -mf16c (set per file by CMake)"
#endif

#include <immintrin.h>

#include "ukernels/common/x86/avx2_common.h"
#include "ukernels/f8gemm/x86/f8gemm_x86.h"

namespace cpumoe {
namespace {

struct Avx2 {
  using F = __m256;
  static constexpr int64_t kLanes = 8;
  // No 4-bit codes: a 16-entry fp32 lookup takes two vpermps and a blend per 8 weights on
  // AVX2, more than the E4M3 decode (layers with them are packed with 8-bit codes here).
  static constexpr bool kCodes4 = false;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F load(const float* p) { return _mm256_load_ps(p); }
  static void store(float* p, F v) { _mm256_store_ps(p, v); }
  static F loadu(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
  // 16 codes -> their fp16 bits (the value times 2^-8) -> fp32, 8 per half.
  // The 16 codes of one k -> their fp16 bits (the value times 2^-8) -> fp32, columns 0-7 (lo)
  // and 8-15 (hi). (Two 8-code halves in xmm instead: 0.92x at m = 1.)
  static void decode(const uint8_t* p, F& lo, F& hi) {
    __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    x = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(-16385));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(x));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(x, 1));
  }
  static void store_row(const f8_x86::Call& c, int64_t i, int64_t j0, int64_t nc, F v) {
    StoreF32Acc{c.dst, c.ld, c.ep.bias}(i, j0, nc, v);
  }
  static void finish(const F8GemmEpilogue&) {}
};

struct Steps {
  static constexpr f8_x86::Steps kSmall{1, 4}, kMid{2, 2}, kMain{6, 1};
};

using Packing = F8Packing</*Nr=*/16, f8_x86::kKr, /*LhsBytes=*/4>;

}  // namespace

extern const F8GemmUkernel f8gemm_f32r_f8ck16_6x16_avx2 = make_f8gemm<Packing>(
    "f8gemm_f32r_f8ck16_6x16_avx2", Isa::avx2, Steps::kMain.rows, pack_lhs_f32r<Packing>,
    pack_rhs_f8<Packing, F8Interleaved<16, 1>>, f8_x86::run_f32<Avx2, Steps>);

}  // namespace cpumoe
