/// @file quantize.h
/// The row operations of the MoE pipeline around the GEMMs: per-row int8 quantization (of x and of
/// the activation rows), rounding a row to the input dtype, and storing an fp32 row in a dtype.
/// Each has a scalar form (the definition) and, on AArch64, a baseline-NEON form (Armv8.0
/// Advanced SIMD, which every AArch64 CPU has, so no ISA flag or run-time check is needed) that
/// gives the same bits:
///  - quantization: the absolute maximum with FMAX / FMAXV, which keep a NaN as the scalar rule
///    does (any NaN makes the scale NaN); q = x / s (a true division, as in the scalar form), then
///    FCVTNS (round half to even, NaN -> 0, exactly the scalar magic-number rounding for
///    |v| <= 128), saturating narrows to int8 and a max with -127: the scalar clamp to [-127, 127].
///  - bf16 rounding: the integer round-to-nearest-even of dtype.h, lane-wise.
///  - f16 rounding: FCVTN / FCVTL (IEEE round to nearest even with subnormals, overflow to inf,
///    as f32_to_f16), with NaN lanes replaced by the canonical quiet NaN f32_to_f16 produces.
/// Header-only; internal to the dispatcher (csrc/moe) and its tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "cpumoe/activation.h"
#include "cpumoe/dtype.h"
#include "cpumoe/moe.h"  // kAmaxFloor

#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace cpumoe {
namespace rowops {

/// The scalar definition of one element: q = round_half_even(v / s) clamped to [-127, 127], NaN
/// to 0.
inline int8_t quantize_one(float x, float s) {
  float v = x / s;
  v = (v + 12582912.0f) - 12582912.0f;  // round half to even (|v| <= 127 here)
  v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
  return v == v ? int8_t(v) : int8_t(0);  // NaN quantizes to 0 instead of undefined behaviour
}

/// A NaN sticks: once amax is NaN it stays NaN.
inline float amax_step(float amax, float a) { return (a > amax || a != a) ? a : amax; }

/// The second half of quantize() below, given the row's absolute maximum amax.
template <class Load1, class Load4>
inline float quantize_with_amax(int64_t n, int8_t* q, float amax, const Load1& load,
                                const Load4& load4) {
  // NaN stays NaN (std::max returns its first argument when the comparison is false); an inf
  // gives an inf scale. Either way every q is 0 and the row's results are NaN.
  const float s = std::max(amax, kAmaxFloor) / 127.0f;
  int64_t i = 0;
#if defined(__aarch64__)
  const float32x4_t sv = vdupq_n_f32(s);
  const int8x16_t lo = vdupq_n_s8(-127);
  for (; i + 16 <= n; i += 16) {
    const int32x4_t a0 = vcvtnq_s32_f32(vdivq_f32(load4(i), sv));
    const int32x4_t a1 = vcvtnq_s32_f32(vdivq_f32(load4(i + 4), sv));
    const int32x4_t a2 = vcvtnq_s32_f32(vdivq_f32(load4(i + 8), sv));
    const int32x4_t a3 = vcvtnq_s32_f32(vdivq_f32(load4(i + 12), sv));
    const int16x8_t h0 = vqmovn_high_s32(vqmovn_s32(a0), a1);
    const int16x8_t h1 = vqmovn_high_s32(vqmovn_s32(a2), a3);
    vst1q_s8(q + i, vmaxq_s8(vqmovn_high_s16(vqmovn_s16(h0), h1), lo));
  }
#else
  (void)load4;
#endif
  for (; i < n; ++i) q[i] = quantize_one(load(i), s);
  return s;
}

/// Quantizes n elements, element i being load(i) (fp32) and, on AArch64, load4(i) its 4 lanes
/// from i; writes q[0..n), returns the scale s = max(max|x|, kAmaxFloor) / 127.
template <class Load1, class Load4>
inline float quantize(int64_t n, int8_t* q, const Load1& load, const Load4& load4) {
  float amax = 0.0f;
  int64_t i = 0;
#if defined(__aarch64__)
  if (n >= 16) {
    float32x4_t m0 = vdupq_n_f32(0.0f), m1 = m0, m2 = m0, m3 = m0;
    for (; i + 16 <= n; i += 16) {
      m0 = vmaxq_f32(m0, vabsq_f32(load4(i)));
      m1 = vmaxq_f32(m1, vabsq_f32(load4(i + 4)));
      m2 = vmaxq_f32(m2, vabsq_f32(load4(i + 8)));
      m3 = vmaxq_f32(m3, vabsq_f32(load4(i + 12)));
    }
    amax = vmaxvq_f32(vmaxq_f32(vmaxq_f32(m0, m1), vmaxq_f32(m2, m3)));
  }
#endif
  for (; i < n; ++i) amax = amax_step(amax, std::fabs(load(i)));
  return quantize_with_amax(n, q, amax, load, load4);
}

/// Dynamic symmetric int8 quantization of one row of @p n elements of type @p dt (moe.h).
inline float quantize_row(const void* x, DType dt, int64_t n, int8_t* q) {
  const auto* f = static_cast<const float*>(x);
  const auto* h = static_cast<const uint16_t*>(x);
#if defined(__aarch64__)
  auto f32x4 = [f](int64_t i) { return vld1q_f32(f + i); };
  auto bf16x4 = [h](int64_t i) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(h + i), 16)); };
  auto f16x4 = [h](int64_t i) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i))); };
#else
  const std::nullptr_t f32x4 = nullptr, bf16x4 = nullptr, f16x4 = nullptr;
#endif
  switch (dt) {
    case DType::f32: return quantize(n, q, [f](int64_t i) { return f[i]; }, f32x4);
    case DType::bf16: return quantize(n, q, [h](int64_t i) { return bf16_to_f32(h[i]); }, bf16x4);
    case DType::f16: return quantize(n, q, [h](int64_t i) { return f16_to_f32(h[i]); }, f16x4);
  }
  return 1.0f;
}

#if defined(__aarch64__)
// bf16 bits of 4 fp32 lanes in the high halves (low halves zero): f32_to_bf16, lane-wise.
inline uint32x4_t bf16_round4(float32x4_t v) {
  const uint32x4_t u = vreinterpretq_u32_f32(v);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  const uint32x4_t r = vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fffu)), lsb);
  const uint32x4_t quiet = vorrq_u32(u, vdupq_n_u32(0x400000u));  // NaN: stays a quiet NaN
  return vandq_u32(vbslq_u32(vceqq_f32(v, v), r, quiet), vdupq_n_u32(0xffff0000u));
}
// f16 bits of 4 fp32 lanes: f32_to_f16, lane-wise (NaN: sign | 0x7e00).
inline uint16x4_t f16_round4(float32x4_t v) {
  const uint16x4_t h = vreinterpret_u16_f16(vcvt_f16_f32(v));
  const uint16x4_t nan = vmovn_u32(vmvnq_u32(vceqq_f32(v, v)));
  const uint16x4_t quiet =
      vorr_u16(vshrn_n_u32(vandq_u32(vreinterpretq_u32_f32(v), vdupq_n_u32(0x80000000u)), 16),
               vdup_n_u16(0x7e00));
  return vbsl_u16(nan, quiet, h);
}

/// How the NEON row ops below round fp32 lanes to bf16: the integer rule of dtype.h in baseline
/// NEON. A variant built with FEAT_BF16 (rowops_neon_bf16) passes its own, with the same bits.
struct IntegerBf16 {
  /// round_to_dtype(v, bf16), lane-wise.
  static CPUMOE_NEON_INLINE float32x4_t round4(float32x4_t v) {
    return vreinterpretq_f32_u32(bf16_round4(v));
  }
  /// f32_to_bf16 of v's lanes.
  static CPUMOE_NEON_INLINE uint16x4_t narrow4(float32x4_t v) {
    return vshrn_n_u32(bf16_round4(v), 16);
  }
  /// f32_to_bf16 of a's lanes, then b's.
  static CPUMOE_NEON_INLINE uint16x8_t narrow8(float32x4_t a, float32x4_t b) {
    return vcombine_u16(vshrn_n_u32(bf16_round4(a), 16), vshrn_n_u32(bf16_round4(b), 16));
  }
};
#else
struct IntegerBf16 {};  // the NEON forms' bf16 rounding; nothing to choose elsewhere
#endif

/// a[i] = round_to_dtype(a[i], dt) for i in [0, n).
inline void round_row(float* a, int64_t n, DType dt) {
  if (dt == DType::f32) return;
  int64_t i = 0;
#if defined(__aarch64__)
  if (dt == DType::bf16) {
    for (; i + 4 <= n; i += 4)
      vst1q_f32(a + i, vreinterpretq_f32_u32(bf16_round4(vld1q_f32(a + i))));
  } else {
    for (; i + 4 <= n; i += 4)
      vst1q_f32(a + i, vcvt_f32_f16(vreinterpret_f16_u16(f16_round4(vld1q_f32(a + i)))));
  }
#endif
  for (; i < n; ++i) a[i] = round_to_dtype(a[i], dt);
}

/// Stores n fp32 values in dtype dt (rounding to nearest even).
inline void store_row(const float* acc, int64_t n, DType dt, void* dst) {
  if (dt == DType::f32) {
    std::memcpy(dst, acc, size_t(n) * 4);
    return;
  }
  auto* d = static_cast<uint16_t*>(dst);
  int64_t i = 0;
#if defined(__aarch64__)
  if (dt == DType::bf16) {
    for (; i + 4 <= n; i += 4) vst1_u16(d + i, vshrn_n_u32(bf16_round4(vld1q_f32(acc + i)), 16));
  } else {
    for (; i + 4 <= n; i += 4) vst1_u16(d + i, f16_round4(vld1q_f32(acc + i)));
  }
#endif
  for (; i < n; ++i) d[i] = dt == DType::bf16 ? f32_to_bf16(acc[i]) : f32_to_f16(acc[i]);
}

namespace detail {
template <DType kDt>
inline float round_one(float v) {
  return kDt == DType::f32 ? v : round_to_dtype(v, kDt);
}
#if defined(__aarch64__)
template <DType kDt, class Bf16>
CPUMOE_NEON_INLINE float32x4_t round4(float32x4_t v) {
  if constexpr (kDt == DType::bf16) return Bf16::round4(v);
  if constexpr (kDt == DType::f16) return vcvt_f32_f16(vreinterpret_f16_u16(f16_round4(v)));
  return v;
}
#endif

template <DType kDt, class Bf16 = IntegerBf16>
inline float activate_round(Activation act, const float* row, int64_t inter, float* a) {
  const GateUpLayout l = gate_up_layout(act, inter);
  const float* gate = row + l.gate_offset;
  const float* up = row + l.up_offset;
  float amax = 0.0f;
#if defined(__aarch64__)
  float32x4_t m = vdupq_n_f32(0.0f);
  const int64_t i0 = vec::gated_vector_part(act, gate, up, l.stride, inter,
                                            [&](int64_t i, float32x4_t v)
                                                CPUMOE_NEON_INLINE_LAMBDA {
                                              v = round4<kDt, Bf16>(v);
                                              vst1q_f32(a + i, v);
                                              m = vmaxq_f32(m, vabsq_f32(v));
                                            });
  if (i0 > 0) amax = vmaxvq_f32(m);
#else
  const int64_t i0 = 0;
#endif
  for (int64_t i = i0; i < inter; ++i) {
    a[i] = round_one<kDt>(vec::apply(act, gate[i * l.stride], up[i * l.stride]));
    amax = amax_step(amax, std::fabs(a[i]));
  }
  return amax;
}
}  // namespace detail

/// The activation row of the op: a[0..inter) = round_to_dtype(act(gate, up)) of a GEMM1 row of
/// 2 * inter values (vec::gated_row then round_row, in one pass); returns max |a| with a NaN
/// sticking, for quantize_row_with_amax.
inline float activate_round_row(Activation act, const float* row, int64_t inter, DType dt,
                                float* a) {
  return with_dtype(dt, [&](auto kDt) { return detail::activate_round<kDt()>(act, row, inter, a); });
}

namespace detail {
template <class Bf16 = IntegerBf16>
inline void activate_bf16(Activation act, const float* row, int64_t inter, uint16_t* out) {
  const GateUpLayout l = gate_up_layout(act, inter);
  const float* gate = row + l.gate_offset;
  const float* up = row + l.up_offset;
#if defined(__aarch64__)
  const int64_t i0 = vec::gated_vector_part(
      act, gate, up, l.stride, inter, [&](int64_t i, float32x4_t v) CPUMOE_NEON_INLINE_LAMBDA {
        vst1_u16(out + i, Bf16::narrow4(v));
      });
#else
  const int64_t i0 = 0;
#endif
  with_activation(act, [&](auto kAct) {  // one straight loop per activation
    for (int64_t i = i0; i < inter; ++i)
      out[i] = f32_to_bf16(vec::apply(kAct(), gate[i * l.stride], up[i * l.stride]));
  });
}
}  // namespace detail

/// The bf16 op's activation row: out[0..inter) = f32_to_bf16(act(gate, up)) of a GEMM1 row of
/// 2 * inter values (vec::gated_row then store_row, in one pass).
inline void activate_bf16_row(Activation act, const float* row, int64_t inter, uint16_t* out) {
  detail::activate_bf16<>(act, row, inter, out);
}

/// quantize_row(a, DType::f32, n, q) for a row whose max |a| (NaN sticking) is already known.
inline float quantize_row_with_amax(const float* a, int64_t n, float amax, int8_t* q) {
#if defined(__aarch64__)
  auto load4 = [a](int64_t i) { return vld1q_f32(a + i); };
#else
  const std::nullptr_t load4 = nullptr;
#endif
  return quantize_with_amax(n, q, amax, [a](int64_t i) { return a[i]; }, load4);
}

namespace detail {
// One pass of weighted_sum_row over NJ slots (0 < NJ <= 8), unrolled so that the weights stay in
// registers; first: the sums start at 0.0f (else from acc); last: they go to dst, else to acc.
template <int NJ, class Bf16 = IntegerBf16>
inline void weighted_sum_pass(const float* const* ys, const float* ws, int64_t n, bool first,
                              bool last, DType dt, void* dst, float* acc) {
  int64_t i = 0;
#if defined(__aarch64__)
  float32x4_t w[NJ];
  const float* y[NJ];
  for (int s = 0; s < NJ; ++s) {
    w[s] = vdupq_n_f32(ws[s]);
    y[s] = ys[s];
  }
  for (; i + 8 <= n; i += 8) {
    float32x4_t a0 = first ? vdupq_n_f32(0.0f) : vld1q_f32(acc + i);
    float32x4_t a1 = first ? vdupq_n_f32(0.0f) : vld1q_f32(acc + i + 4);
    for (int s = 0; s < NJ; ++s) {
      const float32x4x2_t v = vld1q_f32_x2(y[s] + i);  // one ld1 of 8 floats
      a0 = vaddq_f32(a0, vmulq_f32(w[s], v.val[0]));
      a1 = vaddq_f32(a1, vmulq_f32(w[s], v.val[1]));
    }
    if (!last) {
      vst1q_f32(acc + i, a0);
      vst1q_f32(acc + i + 4, a1);
    } else if (dt == DType::f32) {
      vst1q_f32(static_cast<float*>(dst) + i, a0);
      vst1q_f32(static_cast<float*>(dst) + i + 4, a1);
    } else if (dt == DType::bf16) {
      vst1q_u16(static_cast<uint16_t*>(dst) + i, Bf16::narrow8(a0, a1));
    } else {
      vst1q_u16(static_cast<uint16_t*>(dst) + i, vcombine_u16(f16_round4(a0), f16_round4(a1)));
    }
  }
#endif
  for (; i < n; ++i) {
    float a = first ? 0.0f : acc[i];
    for (int s = 0; s < NJ; ++s) a += ws[s] * ys[s][i];
    if (!last) acc[i] = a;
    else if (dt == DType::f32) static_cast<float*>(dst)[i] = a;
    else static_cast<uint16_t*>(dst)[i] = dt == DType::bf16 ? f32_to_bf16(a) : f32_to_f16(a);
  }
}
}  // namespace detail

/// f(std::integral_constant<int, nj>{}) for a slot count nj in 1..8 (8 for anything larger): the
/// passes of the weighted combine are unrolled over their slots.
template <class F>
inline void with_slot_count(int nj, const F& f) {
  switch (nj) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

/// detail::weighted_sum_pass for a run-time slot count nj in 1..8 (RowOps::weighted_sum_pass).
inline void weighted_sum_pass(int nj, const float* const* ys, const float* ws, int64_t n,
                              bool first, bool last, DType dt, void* dst, float* acc) {
  with_slot_count(nj, [&](auto kNj) {
    detail::weighted_sum_pass<kNj()>(ys, ws, n, first, last, dt, dst, acc);
  });
}

/// The signature of a weighted_sum_pass (this one, or a RowOps variant's).
using WeightedSumPass = void (*)(int nj, const float* const* ys, const float* ws, int64_t n,
                                 bool first, bool last, DType dt, void* dst, float* acc);

/// dst = sum over the slots j < count with slot(j, &y, &w) true of w * y[0..n), in fp32, in
/// order from 0.0f (the bits of `acc = 0; for each slot: acc[i] += w * y[i]`), stored in dtype
/// dt; no slot: zeros. Up to 8 slots are summed in registers per pass over the row (by @p pass);
/// acc (n floats of scratch) carries the sums between passes when there are more.
template <class Slot>
inline void weighted_sum_row(int64_t count, const Slot& slot, int64_t n, DType dt, void* dst,
                             float* acc, WeightedSumPass pass = &weighted_sum_pass) {
  constexpr int kFused = 8;
  const float* ys[kFused];
  float ws[kFused];
  int64_t j = 0;
  bool first = true;
  for (;;) {
    int nj = 0;
    for (; j < count && nj < kFused; ++j)
      if (slot(j, &ys[nj], &ws[nj])) ++nj;
    bool last = true;  // no valid slot after these?
    for (int64_t r = j; r < count && last; ++r) {
      const float* yr;
      float wr;
      last = !slot(r, &yr, &wr);
    }
    if (nj == 0) {  // no slot at all (nj is 0 only then): zeros
      std::fill(acc, acc + n, 0.0f);
      store_row(acc, n, dt, dst);
      return;
    }
    pass(nj, ys, ws, n, first, last, dt, dst, acc);
    if (last) return;
    first = false;
  }
}

}  // namespace rowops
}  // namespace cpumoe
