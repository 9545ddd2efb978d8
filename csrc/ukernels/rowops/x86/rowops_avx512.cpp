// rowops_avx512: the row operations (cpumoe/rowops.h) on AVX-512 F/BW/VL, 16 fp32 lanes, every
// tail a masked load / store (no scalar remainder; masked-off lanes never fault). The algorithms
// and why they give the scalar bits: ../rowops_vec.h. Level avx512_vnni, whose CPUs all have F/BW/VL.
#if !defined(__x86_64__) || !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "rowops_avx512.cpp needs -mavx512f -mavx512bw -mavx512vl (set per file by CMake)"
#endif

#include <immintrin.h>

#include "ukernels/rowops/x86/rowops_x86.h"

namespace cpumoe {
namespace {

struct Avx512 {
  using V = __m512;
  using VI = __m512i;
  using H = __m256i;
  using Tail = __mmask16;
  static constexpr int64_t kLanes = 16;

  static CPUMOE_ROWOPS_INLINE Tail tail(int64_t r) {
    return r >= kLanes ? Tail(0xffff) : Tail((1u << r) - 1u);
  }
  static CPUMOE_ROWOPS_INLINE V splat(float f) { return _mm512_set1_ps(f); }
  static CPUMOE_ROWOPS_INLINE V add(V a, V b) { return _mm512_add_ps(a, b); }
  static CPUMOE_ROWOPS_INLINE V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static CPUMOE_ROWOPS_INLINE V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static CPUMOE_ROWOPS_INLINE V div(V a, V b) { return _mm512_div_ps(a, b); }
  static CPUMOE_ROWOPS_INLINE V min(V c, V x) { return _mm512_min_ps(c, x); }
  static CPUMOE_ROWOPS_INLINE V max(V c, V x) { return _mm512_max_ps(c, x); }
  static CPUMOE_ROWOPS_INLINE VI bits(V v) { return _mm512_castps_si512(v); }
  static CPUMOE_ROWOPS_INLINE V from_bits(VI v) { return _mm512_castsi512_ps(v); }
  static CPUMOE_ROWOPS_INLINE VI seti(int32_t v) { return _mm512_set1_epi32(v); }
  static CPUMOE_ROWOPS_INLINE VI and_(VI a, VI b) { return _mm512_and_si512(a, b); }
  static CPUMOE_ROWOPS_INLINE VI or_(VI a, VI b) { return _mm512_or_si512(a, b); }
  static CPUMOE_ROWOPS_INLINE VI xor_(VI a, VI b) { return _mm512_xor_si512(a, b); }
  static CPUMOE_ROWOPS_INLINE VI addi(VI a, VI b) { return _mm512_add_epi32(a, b); }
  template <int N>
  static CPUMOE_ROWOPS_INLINE VI srli(VI a) { return _mm512_srli_epi32(a, N); }
  template <int N>
  static CPUMOE_ROWOPS_INLINE VI slli(VI a) { return _mm512_slli_epi32(a, N); }
  static CPUMOE_ROWOPS_INLINE VI max_u32(VI a, VI b) { return _mm512_max_epu32(a, b); }
  static CPUMOE_ROWOPS_INLINE VI min_i32(VI a, VI b) { return _mm512_min_epi32(a, b); }
  static CPUMOE_ROWOPS_INLINE VI max_i32(VI a, VI b) { return _mm512_max_epi32(a, b); }
  static CPUMOE_ROWOPS_INLINE uint32_t reduce_max_u32(VI a) { return uint32_t(_mm512_reduce_max_epu32(a)); }
  static CPUMOE_ROWOPS_INLINE VI nan_select(V v, VI if_number, VI if_nan) {
    return _mm512_mask_mov_epi32(if_number, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), if_nan);
  }
  static CPUMOE_ROWOPS_INLINE VI cvtt_or_zero(V n) {
    return _mm512_maskz_cvttps_epi32(_mm512_cmp_ps_mask(n, n, _CMP_ORD_Q), n);
  }
  static CPUMOE_ROWOPS_INLINE VI cvt_rne(V v) {
    return _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static CPUMOE_ROWOPS_INLINE V copysign(V mag, V sgn) {  // 0xca: a ? b : c, bitwise
    return from_bits(_mm512_ternarylogic_epi32(seti(0x7fffffff), bits(mag), bits(sgn), 0xca));
  }
  static CPUMOE_ROWOPS_INLINE void deinterleave(V lo, V hi, V* even, V* odd) {
    const VI e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *even = _mm512_permutex2var_ps(lo, e, hi);
    *odd = _mm512_permutex2var_ps(lo, _mm512_add_epi32(e, seti(1)), hi);
  }
  static CPUMOE_ROWOPS_INLINE V load_f32(const float* p, Tail t) { return _mm512_maskz_loadu_ps(t, p); }
  static CPUMOE_ROWOPS_INLINE H load_h(const uint16_t* p, Tail t) { return _mm256_maskz_loadu_epi16(t, p); }
  static CPUMOE_ROWOPS_INLINE void store_f32(float* p, Tail t, V v) { _mm512_mask_storeu_ps(p, t, v); }
  static CPUMOE_ROWOPS_INLINE void store_h(uint16_t* p, Tail t, H h) { _mm256_mask_storeu_epi16(p, t, h); }
  static CPUMOE_ROWOPS_INLINE void store_i8(int8_t* p, Tail t, VI v) {
    _mm512_mask_cvtepi32_storeu_epi8(p, t, v);
  }
  static CPUMOE_ROWOPS_INLINE V widen_bf16(H h) {
    return from_bits(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static CPUMOE_ROWOPS_INLINE H narrow_high(VI v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)); }
  static CPUMOE_ROWOPS_INLINE H f16_from(V v) {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static CPUMOE_ROWOPS_INLINE V f32_from_f16(H h) { return _mm512_cvtph_ps(h); }
  static CPUMOE_ROWOPS_INLINE H f16_nan_fix(H h, V v) {
    const VI quiet = or_(and_(srli<16>(bits(v)), seti(0x8000)), seti(0x7e00));
    return _mm256_mask_mov_epi16(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_cvtepi32_epi16(quiet));
  }
};

}  // namespace

extern const RowOps rowops_avx512 = rowops_vec::make_rowops<rowops_vec::X86<Avx512>>("rowops_avx512", Isa::avx512_vnni);

}  // namespace cpumoe
