// rowops_avx512: the row operations (cpumoe/rowops.h) on AVX-512 F/BW/VL, 16 fp32 lanes, every
// tail a masked load / store (no scalar remainder). The bits are those of the scalar definitions:
//  - every arithmetic step is the scalar form's IEEE operation in the same order (no FMA, no
//    reciprocal approximations: a division stays VDIVPS);
//  - a ternary clamp `x > c ? c : x` is VMINPS(c, x) and `x < c ? c : x` is VMAXPS(c, x): both
//    return their second operand when either is NaN, as the ternaries keep x;
//  - the absolute maximum is an unsigned max of |x|'s bits (the order of non-negative floats), and
//    a row with a NaN falls back to the scalar rule for the exact NaN the scalar code returns;
//  - rounding to int8 is VCVTPS2DQ with round-to-nearest-even in the instruction (independent of
//    MXCSR), which is the scalar magic-number rounding for |v| <= 128; a non-finite scale (inf or
//    NaN amax) quantizes every element to 0, as x / s does in the scalar form;
//  - bf16 rounding is the integer rule of dtype.h; f16 is VCVTPS2PH (IEEE round to nearest even,
//    subnormals, overflow to inf) with NaN lanes set to sign | 0x7e00 as f32_to_f16 does.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpumoe/quantize.h"  // the scalar definitions (NaN fallbacks)
#include "cpumoe/rowops.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "rowops_avx512.cpp needs -mavx512f -mavx512bw -mavx512vl (set per file by CMake)"
#endif

namespace cpumoe {
namespace {

using V = __m512;
using VI = __m512i;
#define CPUMOE_AVX512_INLINE inline __attribute__((always_inline))
#define CPUMOE_AVX512_INLINE_LAMBDA __attribute__((always_inline))

constexpr int64_t kLanes = 16;
constexpr uint32_t kInfBits = 0x7f800000u;

CPUMOE_AVX512_INLINE __mmask16 lanes(int64_t r) {
  return r >= kLanes ? __mmask16(0xffff) : __mmask16((1u << r) - 1u);
}
CPUMOE_AVX512_INLINE V splat(float f) { return _mm512_set1_ps(f); }
CPUMOE_AVX512_INLINE V add(V a, V b) { return _mm512_add_ps(a, b); }
CPUMOE_AVX512_INLINE V sub(V a, V b) { return _mm512_sub_ps(a, b); }
CPUMOE_AVX512_INLINE V mul(V a, V b) { return _mm512_mul_ps(a, b); }
CPUMOE_AVX512_INLINE V div(V a, V b) { return _mm512_div_ps(a, b); }
CPUMOE_AVX512_INLINE VI bits(V v) { return _mm512_castps_si512(v); }
CPUMOE_AVX512_INLINE V from_bits(VI v) { return _mm512_castsi512_ps(v); }
CPUMOE_AVX512_INLINE V neg(V x) {
  return from_bits(_mm512_xor_si512(bits(x), _mm512_set1_epi32(int32_t(0x80000000u))));
}
CPUMOE_AVX512_INLINE VI abs_bits(V x) {
  return _mm512_and_si512(bits(x), _mm512_set1_epi32(0x7fffffff));
}

// --- The activations: vec:: of activation.h, operation for operation ---------------------------

CPUMOE_AVX512_INLINE V exp(V x) {
  x = _mm512_min_ps(splat(88.3f), x);
  x = _mm512_max_ps(splat(-87.3f), x);
  const V magic = splat(12582912.0f);
  const V n = sub(add(mul(x, splat(1.44269504088896341f)), magic), magic);
  V r = sub(x, mul(n, splat(0.693145751953125f)));
  r = sub(r, mul(n, splat(1.42860682030941723e-06f)));
  V p = splat(1.9875691500e-4f);
  p = add(mul(p, r), splat(1.3981999507e-3f));
  p = add(mul(p, r), splat(8.3334519073e-3f));
  p = add(mul(p, r), splat(4.1665795894e-2f));
  p = add(mul(p, r), splat(1.6666665459e-1f));
  p = add(mul(p, r), splat(5.0000001201e-1f));
  p = add(add(mul(mul(p, r), r), r), splat(1.0f));
  // int(n), NaN -> 0 as the scalar's guarded cast (n is integral and |n| <= 127 otherwise).
  const VI ni = _mm512_maskz_cvttps_epi32(_mm512_cmp_ps_mask(n, n, _CMP_ORD_Q), n);
  const V scale = from_bits(_mm512_slli_epi32(_mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23));
  return mul(p, scale);
}

CPUMOE_AVX512_INLINE V sigmoid(V x) {
  const V one = splat(1.0f);
  return div(one, add(one, exp(neg(x))));
}

CPUMOE_AVX512_INLINE V erf(V x) {
  const V one = splat(1.0f);
  const V ax = from_bits(abs_bits(x));
  const V t = div(one, add(one, mul(splat(0.3275911f), ax)));
  V p = splat(1.061405429f);
  p = sub(mul(p, t), splat(1.453152027f));
  p = add(mul(p, t), splat(1.421413741f));
  p = sub(mul(p, t), splat(0.284496736f));
  p = add(mul(p, t), splat(0.254829592f));
  const V y = sub(one, mul(mul(p, t), exp(mul(neg(ax), ax))));
  // copysign(y, x): magnitude bits from y, the sign bit from x (0xca: a ? b : c, bitwise).
  return from_bits(_mm512_ternarylogic_epi32(_mm512_set1_epi32(0x7fffffff), bits(y), bits(x), 0xca));
}

CPUMOE_AVX512_INLINE V tanh(V x) {
  const V one = splat(1.0f);
  return sub(one, div(splat(2.0f), add(exp(mul(splat(2.0f), x)), one)));
}

template <Activation A>
CPUMOE_AVX512_INLINE V activate(V g, V u) {
  if constexpr (A == Activation::silu) {
    return mul(mul(g, sigmoid(g)), u);
  } else if constexpr (A == Activation::gelu) {
    const V e = erf(mul(g, splat(0.70710678118654752f)));
    return mul(mul(mul(splat(0.5f), g), add(splat(1.0f), e)), u);
  } else if constexpr (A == Activation::gelu_tanh) {
    const V cube = mul(mul(mul(splat(kGeluTanhA), g), g), g);
    const V th = tanh(mul(splat(kGeluTanhC), add(g, cube)));
    return mul(mul(mul(splat(0.5f), g), add(splat(1.0f), th)), u);
  } else {
    const V lim = splat(kSwigluLimit);
    g = _mm512_min_ps(lim, g);
    u = _mm512_min_ps(lim, _mm512_max_ps(splat(-kSwigluLimit), u));
    return mul(mul(add(u, splat(1.0f)), g), sigmoid(mul(splat(kSwigluAlpha), g)));
  }
}

// sink(i, mask, act(gate, up) of lanes i..i+15) over a GEMM1 row of 2 * inter values, in the
// layout of gate_up_layout(A): halves, or (swigluoai) gate and up interleaved.
template <Activation A, class Sink>
CPUMOE_AVX512_INLINE void gated_row(const float* row, int64_t inter, const Sink& sink) {
  if constexpr (A == Activation::swigluoai) {
    const VI even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const VI odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int64_t i = 0; i < inter; i += kLanes) {
      const int64_t r = 2 * (inter - i);  // floats left in the row
      const V lo = _mm512_maskz_loadu_ps(lanes(r), row + 2 * i);
      const V hi = _mm512_maskz_loadu_ps(lanes(std::max<int64_t>(r - kLanes, 0)), row + 2 * i + kLanes);
      sink(i, lanes(inter - i),
           activate<A>(_mm512_permutex2var_ps(lo, even, hi), _mm512_permutex2var_ps(lo, odd, hi)));
    }
  } else {
    for (int64_t i = 0; i < inter; i += kLanes) {
      const __mmask16 m = lanes(inter - i);
      sink(i, m, activate<A>(_mm512_maskz_loadu_ps(m, row + i), _mm512_maskz_loadu_ps(m, row + inter + i)));
    }
  }
}

// --- dtype conversions ----------------------------------------------------------------------

template <DType D>
CPUMOE_AVX512_INLINE V load(const void* x, int64_t i, __mmask16 m) {
  if constexpr (D == DType::f32) {
    return _mm512_maskz_loadu_ps(m, static_cast<const float*>(x) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(x) + i);
    if constexpr (D == DType::bf16) return from_bits(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
}

// f32_to_bf16 of each lane, in the high half (low half zero).
CPUMOE_AVX512_INLINE VI bf16_bits_high(V v) {
  const VI u = bits(v);
  const VI lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const VI r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  const VI quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));  // NaN stays a quiet NaN
  const VI out = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
  return _mm512_and_si512(out, _mm512_set1_epi32(int32_t(0xffff0000u)));
}

// f32_to_f16 of each lane.
CPUMOE_AVX512_INLINE __m256i f16_bits(V v) {
  const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const VI sign = _mm512_and_si512(_mm512_srli_epi32(bits(v), 16), _mm512_set1_epi32(0x8000));
  const __m256i quiet = _mm512_cvtepi32_epi16(_mm512_or_si512(sign, _mm512_set1_epi32(0x7e00)));
  return _mm256_mask_mov_epi16(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
}

// round_to_dtype(v, D), lane-wise.
template <DType D>
CPUMOE_AVX512_INLINE V round_to(V v) {
  if constexpr (D == DType::bf16) return from_bits(bf16_bits_high(v));
  if constexpr (D == DType::f16) return _mm512_cvtph_ps(f16_bits(v));
  return v;
}

// Stores the masked lanes of v at element i of dst in dtype dt (rounding to nearest even).
CPUMOE_AVX512_INLINE void store(V v, DType dt, void* dst, int64_t i, __mmask16 m) {
  if (dt == DType::f32) {
    _mm512_mask_storeu_ps(static_cast<float*>(dst) + i, m, v);
  } else if (dt == DType::bf16) {
    _mm512_mask_cvtepi32_storeu_epi16(static_cast<uint16_t*>(dst) + i, m,
                                      _mm512_srli_epi32(bf16_bits_high(v), 16));
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(dst) + i, m, f16_bits(v));
  }
}

// --- quantization ----------------------------------------------------------------------------

// The scalar amax of a row (the NaN it returns is the last NaN met, as amax_step has it).
template <DType D>
float scalar_amax(const void* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = rowops::amax_step(amax, std::fabs(load_as_f32(x, D, i)));
  return amax;
}

// The row's amax from the unsigned max of |x| bits: exact unless a NaN is among them.
template <DType D>
CPUMOE_AVX512_INLINE float amax_from(VI m, const void* x, int64_t n) {
  const uint32_t b = uint32_t(_mm512_reduce_max_epu32(m));
  if (b > kInfBits) return scalar_amax<D>(x, n);
  float a;
  std::memcpy(&a, &b, 4);
  return a;
}

template <DType D>
float quantize_with_amax(const void* x, int64_t n, float amax, int8_t* q) {
  // NaN stays NaN (std::max keeps its first argument), an inf gives an inf scale.
  const float s = std::max(amax, kAmaxFloor) / 127.0f;
  if (!(std::fabs(s) <= 3.4028235e38f)) {  // x / s is 0 or NaN for every x: all quantize to 0
    std::memset(q, 0, size_t(n));
    return s;
  }
  const V sv = splat(s);
  const VI hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes(n - i);
    const VI r = _mm512_cvt_roundps_epi32(div(load<D>(x, i, m), sv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm512_mask_cvtepi32_storeu_epi8(q + i, m, _mm512_max_epi32(_mm512_min_epi32(r, hi), lo));
  }
  return s;
}

template <DType D>
float quantize_t(const void* x, int64_t n, int8_t* q) {
  VI m0 = _mm512_setzero_si512(), m1 = m0;
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    m0 = _mm512_max_epu32(m0, abs_bits(load<D>(x, i, 0xffff)));
    m1 = _mm512_max_epu32(m1, abs_bits(load<D>(x, i + kLanes, 0xffff)));
  }
  for (; i < n; i += kLanes) m0 = _mm512_max_epu32(m0, abs_bits(load<D>(x, i, lanes(n - i))));
  return quantize_with_amax<D>(x, n, amax_from<D>(_mm512_max_epu32(m0, m1), x, n), q);
}

float quantize(const void* x, DType dt, int64_t n, int8_t* q) {
  return with_dtype(dt, [&](auto kDt) { return quantize_t<kDt()>(x, n, q); });
}

// --- the activation rows ----------------------------------------------------------------------

template <Activation A, DType D>
float activate_round_t(const float* row, int64_t inter, float* a) {
  VI m = _mm512_setzero_si512();
  gated_row<A>(row, inter, [&](int64_t i, __mmask16 mk, V v) CPUMOE_AVX512_INLINE_LAMBDA {
    v = round_to<D>(v);
    _mm512_mask_storeu_ps(a + i, mk, v);
    m = _mm512_mask_max_epu32(m, mk, m, abs_bits(v));
  });
  return amax_from<DType::f32>(m, a, inter);
}

float activate_round(Activation act, const float* row, int64_t inter, DType dt, float* a) {
  return with_activation(act, [&](auto kAct) {
    return with_dtype(dt, [&](auto kDt) { return activate_round_t<kAct(), kDt()>(row, inter, a); });
  });
}

float quantize_f32_with_amax(const float* a, int64_t n, float amax, int8_t* q) {
  return quantize_with_amax<DType::f32>(a, n, amax, q);
}

template <Activation A>
void activate_bf16_t(const float* row, int64_t inter, uint16_t* out) {
  gated_row<A>(row, inter, [&](int64_t i, __mmask16 mk, V v) CPUMOE_AVX512_INLINE_LAMBDA {
    store(v, DType::bf16, out, i, mk);
  });
}

void activate_bf16(Activation act, const float* row, int64_t inter, float* /*tmp*/,
                   uint16_t* out) {
  with_activation(act, [&](auto kAct) { activate_bf16_t<kAct()>(row, inter, out); });
}

template <DType D>
void to_bf16_t(const void* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes(n - i);
    store(load<D>(x, i, m), DType::bf16, out, i, m);
  }
}

void to_bf16(const void* x, DType dt, int64_t n, uint16_t* out) {
  with_dtype(dt, [&](auto kDt) { to_bf16_t<kDt()>(x, n, out); });
}

// --- the weighted combine ---------------------------------------------------------------------

template <int NJ>
void weighted_sum_pass_t(const float* const* ys, const float* ws, int64_t n, bool first, bool last,
                         DType dt, void* dst, float* acc) {
  V w[NJ];
  for (int s = 0; s < NJ; ++s) w[s] = splat(ws[s]);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes(n - i);
    V a = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, acc + i);
    for (int s = 0; s < NJ; ++s) a = add(a, mul(w[s], _mm512_maskz_loadu_ps(m, ys[s] + i)));
    if (last) store(a, dt, dst, i, m);
    else _mm512_mask_storeu_ps(acc + i, m, a);
  }
}

void weighted_sum_pass(int nj, const float* const* ys, const float* ws, int64_t n, bool first,
                       bool last, DType dt, void* dst, float* acc) {
  rowops::with_slot_count(nj, [&](auto kNj) {
    weighted_sum_pass_t<kNj()>(ys, ws, n, first, last, dt, dst, acc);
  });
}

}  // namespace

extern const RowOps rowops_avx512 = {
    "rowops_avx512",  Isa::avx512_vnni,     quantize, activate_round, quantize_f32_with_amax,
    activate_bf16,    to_bf16,              weighted_sum_pass,
};

}  // namespace cpumoe
