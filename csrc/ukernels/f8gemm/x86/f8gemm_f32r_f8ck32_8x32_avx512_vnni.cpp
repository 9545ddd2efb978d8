// f8gemm_f32r_f8ck32_8x32_avx512_vnni: the W8A16 FP8 GEMM (bf16 activations x E4M3 codes with fp32
// block scales) on AVX-512 (F, BW, VL: the lowest AVX-512 level; nothing of VNNI is used). The
// logic, layouts and arithmetic are f8gemm_x86.h's, on zmm: blocks of 32 columns (two zmm of
// fp32 per row), per k the 32 code bytes decoded at once (vpmovsxbw zmm with the load, vpsllw,
// vpand, vcvtph2ps of each 256-bit half), the A value broadcast.
// Tiles: up to 2 rows by 4 blocks (128 columns: 4 weight streams, 16 accumulators), up to 4 rows
// by 2 blocks, else 8 rows by 1 block (16 accumulators, 16 FMAs per 32 decoded weights). (Tried
// on Zen 5: 4 rows by 3 blocks, 1 row by 4, 6 rows by 2 for the middle: the same; 12 rows by 1
// block for many rows: spills, 0.4x.)
// 4-bit codes (W4A16): Avx512::decode4, the same weights from half the bytes.
// Column tails are masked stores; stream_dst stores whole aligned lines non-temporally.
// Features used: AVX-512 F, BW, VL.
#if !defined(__x86_64__) || !defined(__AVX512F__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VL__)
#error "f8gemm_f32r_f8ck32_8x32_avx512_vnni.cpp needs -mavx512f -mavx512bw -mavx512vl (set per file by CMake)"
#endif

#include <immintrin.h>

#include "ukernels/common/x86/avx512_common.h"
#include "ukernels/f8gemm/x86/f8gemm_x86.h"

namespace cpumoe {
namespace {

struct Avx512 {
  using F = __m512;
  static constexpr int64_t kLanes = 16;
  static constexpr bool kCodes4 = true;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F bcast(const float* p) { return _mm512_set1_ps(*p); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F load(const float* p) { return _mm512_load_ps(p); }
  static void store(float* p, F v) { _mm512_store_ps(p, v); }
  static F loadu(const uint8_t* p) { return _mm512_loadu_ps(p); }
  // The 32 codes of one k -> their fp16 bits (the value times 2^-8) -> fp32, columns 0-15 (lo)
  // and 16-31 (hi). One zmm for the integer steps rather than two ymm: 39.7 vs 37.4 GB/s at
  // m = 1 (weights in L3).
  static void decode(const uint8_t* p, F& lo, F& hi) {
    __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    x = _mm512_and_si512(_mm512_slli_epi16(x, 7), _mm512_set1_epi16(-16385));
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(x));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(x, 1));
  }
  // 4-bit codes: the 16 bytes of one k (byte j: column j low, 16 + j high) widened to dwords,
  // each nibble looked up by vpermps (which reads an index's low 4 bits): 4 instructions per 32
  // weights where E4M3 codes take 6.
  static void decode4(const uint8_t* p, F tbl, F& lo, F& hi) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_permutexvar_ps(x, tbl);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), tbl);
  }
  static void store_row(const f8_x86::Call& c, int64_t i, int64_t j0, int64_t nc, F v) {
    StoreF32Acc{c.dst, c.ld, c.ep.bias, c.ep.stream_dst}(i, j0, nc, v);
  }
  static void finish(const F8GemmEpilogue& ep) {
    if (ep.stream_dst) _mm_sfence();  // the non-temporal stores visible before the call returns
  }
};

struct Steps {
  static constexpr f8_x86::Steps kSmall{2, 4}, kMid{4, 2}, kMain{8, 1};
};

using Packing = F8Packing</*Nr=*/32, f8_x86::kKr, /*LhsBytes=*/4, /*LhsRows=*/1,
                          /*NibbleSpan=*/16>;

}  // namespace

extern const F8GemmUkernel f8gemm_f32r_f8ck32_8x32_avx512_vnni = make_f8gemm<Packing>(
    "f8gemm_f32r_f8ck32_8x32_avx512_vnni", Isa::avx512_vnni, Steps::kMain.rows,
    pack_lhs_f32r<Packing>, pack_rhs_f8<Packing, F8Interleaved<32, 1>>,
    f8_x86::run_f32<Avx512, Steps>);

}  // namespace cpumoe
