// rowops_avx2: the row operations (cpumoe/rowops.h) on AVX2 + F16C, 8 fp32 lanes. AVX2 has no
// masked 16-bit loads or stores, so a row's last partial chunk goes through a zeroed stack buffer
// (same arithmetic, nothing read or written past the row). The algorithms and why they give the
// scalar bits: ../rowops_vec.h. Level avx2 (whose check includes F16C).
#if !defined(__x86_64__) || !defined(__AVX2__) || !defined(__F16C__)
#error "rowops_avx2.cpp needs -mavx2 -mf16c (set per file by CMake)"
#endif

#include <immintrin.h>

#include <cstring>

#include "ukernels/rowops/x86/rowops_x86.h"

namespace cpumoe {
namespace {

struct Avx2 {
  using V = __m256;
  using VI = __m256i;
  using H = __m128i;
  using Tail = int64_t;  // real lanes of the chunk, 1..8
  static constexpr int64_t kLanes = 8;

  static CPUMOE_ROWOPS_INLINE Tail tail(int64_t r) { return r >= kLanes ? kLanes : r; }
  static CPUMOE_ROWOPS_INLINE V splat(float f) { return _mm256_set1_ps(f); }
  static CPUMOE_ROWOPS_INLINE V add(V a, V b) { return _mm256_add_ps(a, b); }
  static CPUMOE_ROWOPS_INLINE V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static CPUMOE_ROWOPS_INLINE V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static CPUMOE_ROWOPS_INLINE V div(V a, V b) { return _mm256_div_ps(a, b); }
  static CPUMOE_ROWOPS_INLINE V min(V c, V x) { return _mm256_min_ps(c, x); }
  static CPUMOE_ROWOPS_INLINE V max(V c, V x) { return _mm256_max_ps(c, x); }
  static CPUMOE_ROWOPS_INLINE VI bits(V v) { return _mm256_castps_si256(v); }
  static CPUMOE_ROWOPS_INLINE V from_bits(VI v) { return _mm256_castsi256_ps(v); }
  static CPUMOE_ROWOPS_INLINE VI seti(int32_t v) { return _mm256_set1_epi32(v); }
  static CPUMOE_ROWOPS_INLINE VI and_(VI a, VI b) { return _mm256_and_si256(a, b); }
  static CPUMOE_ROWOPS_INLINE VI or_(VI a, VI b) { return _mm256_or_si256(a, b); }
  static CPUMOE_ROWOPS_INLINE VI xor_(VI a, VI b) { return _mm256_xor_si256(a, b); }
  static CPUMOE_ROWOPS_INLINE VI addi(VI a, VI b) { return _mm256_add_epi32(a, b); }
  template <int N>
  static CPUMOE_ROWOPS_INLINE VI srli(VI a) { return _mm256_srli_epi32(a, N); }
  template <int N>
  static CPUMOE_ROWOPS_INLINE VI slli(VI a) { return _mm256_slli_epi32(a, N); }
  static CPUMOE_ROWOPS_INLINE VI max_u32(VI a, VI b) { return _mm256_max_epu32(a, b); }
  static CPUMOE_ROWOPS_INLINE VI min_i32(VI a, VI b) { return _mm256_min_epi32(a, b); }
  static CPUMOE_ROWOPS_INLINE VI max_i32(VI a, VI b) { return _mm256_max_epi32(a, b); }
  static CPUMOE_ROWOPS_INLINE uint32_t reduce_max_u32(VI a) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return uint32_t(_mm_cvtsi128_si32(m));
  }
  static CPUMOE_ROWOPS_INLINE VI nan_select(V v, VI if_number, VI if_nan) {
    return bits(_mm256_blendv_ps(from_bits(if_number), from_bits(if_nan), _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  static CPUMOE_ROWOPS_INLINE VI cvtt_or_zero(V n) {
    return and_(_mm256_cvttps_epi32(n), bits(_mm256_cmp_ps(n, n, _CMP_ORD_Q)));
  }
  static CPUMOE_ROWOPS_INLINE VI cvt_rne(V v) {  // integral after the rounding: the cvt is exact
    return _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static CPUMOE_ROWOPS_INLINE V copysign(V mag, V sgn) {
    return from_bits(or_(and_(bits(mag), seti(0x7fffffff)), and_(bits(sgn), seti(int32_t(0x80000000u)))));
  }
  static CPUMOE_ROWOPS_INLINE void deinterleave(V lo, V hi, V* even, V* odd) {
    // Within 128-bit lanes: lo0 lo2 hi0 hi2 | lo4 lo6 hi4 hi6; then 64-bit pairs 0, 2, 1, 3.
    const V e = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
    const V o = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
  }
  static CPUMOE_ROWOPS_INLINE V load_f32(const float* p, Tail t) {
    if (t == kLanes) return _mm256_loadu_ps(p);
    float buf[kLanes] = {};
    std::memcpy(buf, p, size_t(t) * sizeof(float));
    return _mm256_loadu_ps(buf);
  }
  static CPUMOE_ROWOPS_INLINE H load_h(const uint16_t* p, Tail t) {
    if (t == kLanes) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    uint16_t buf[kLanes] = {};
    std::memcpy(buf, p, size_t(t) * sizeof(uint16_t));
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
  }
  static CPUMOE_ROWOPS_INLINE void store_f32(float* p, Tail t, V v) {
    if (t == kLanes) return _mm256_storeu_ps(p, v);
    float buf[kLanes];
    _mm256_storeu_ps(buf, v);
    std::memcpy(p, buf, size_t(t) * sizeof(float));
  }
  static CPUMOE_ROWOPS_INLINE void store_h(uint16_t* p, Tail t, H h) {
    if (t == kLanes) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    uint16_t buf[kLanes];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(buf), h);
    std::memcpy(p, buf, size_t(t) * sizeof(uint16_t));
  }
  static CPUMOE_ROWOPS_INLINE void store_i8(int8_t* p, Tail t, VI v) {
    // Saturating packs work within 128-bit lanes: bytes 0..3 of each lane are its 4 values.
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v, v), _mm256_setzero_si256());
    const __m128i q = _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    if (t == kLanes) return _mm_storel_epi64(reinterpret_cast<__m128i*>(p), q);
    int8_t buf[16];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(buf), q);
    std::memcpy(p, buf, size_t(t));
  }
  static CPUMOE_ROWOPS_INLINE V widen_bf16(H h) {
    return from_bits(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static CPUMOE_ROWOPS_INLINE H pack_u16(VI v) {  // lanes already in [0, 0xffff]
    return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  }
  static CPUMOE_ROWOPS_INLINE H narrow_high(VI v) { return pack_u16(_mm256_srli_epi32(v, 16)); }
  static CPUMOE_ROWOPS_INLINE H f16_from(V v) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static CPUMOE_ROWOPS_INLINE V f32_from_f16(H h) { return _mm256_cvtph_ps(h); }
  static CPUMOE_ROWOPS_INLINE H f16_nan_fix(H h, V v) {
    const VI quiet = or_(and_(srli<16>(bits(v)), seti(0x8000)), seti(0x7e00));
    const VI nan = bits(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const H nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
    return _mm_blendv_epi8(h, pack_u16(quiet), nan16);
  }
};

}  // namespace

extern const RowOps rowops_avx2 = rowops_vec::make_rowops<rowops_vec::X86<Avx2>>("rowops_avx2", Isa::avx2);

}  // namespace cpumoe
