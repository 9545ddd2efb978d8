/// @file activation.h
/// The four gated activations of the MoE op, in a scalar form (the textbook formula, std::erf /
/// std::tanh / std::exp) and a vector form (branch-free polynomial math over arrays, written so the
/// compiler vectorizes it for whatever ISA the including file is built for).
///
/// Header-only (CMake target cpumoe::activation). No ISA features needed: on AArch64 the array
/// forms use baseline NEON (Armv8.0 Advanced SIMD, which every AArch64 CPU has) through
/// vec::neon, the same operations in the same order as the per-element vec:: forms, so the
/// results are bit for bit those of the per-element forms (the build disables FMA contraction).
///
/// Semantics, per element, with g the gate and u the up projection:
///  - silu:      silu(g) * u = g / (1 + e^-g) * u
///  - gelu:      0.5 g (1 + erf(g / sqrt 2)) u
///  - gelu_tanh: 0.5 g (1 + tanh(0.7978845608 (g + 0.044715 g^3))) u
///  - swigluoai: g' = min(g, 7), u' = clamp(u, -7, 7), (u' + 1) g' sigmoid(1.702 g')
/// Where gate and up live in a row of GEMM1's output [2I] is the caller's choice
/// (see gate_up_layout()): halves for the first three, even/odd columns for swigluoai.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace cpumoe {

enum class Activation : int { silu = 0, gelu = 1, gelu_tanh = 2, swigluoai = 3 };

inline const char* activation_name(Activation a) {
  switch (a) {
    case Activation::silu: return "silu";
    case Activation::gelu: return "gelu";
    case Activation::gelu_tanh: return "gelu_tanh";
    case Activation::swigluoai: return "swigluoai";
  }
  return "?";
}

/// Parses "silu", "gelu", "gelu_tanh", "swigluoai". Returns false for anything else.
inline bool parse_activation(const char* s, Activation* out) {
  static const Activation all[] = {Activation::silu, Activation::gelu, Activation::gelu_tanh,
                                   Activation::swigluoai};
  for (Activation a : all) {
    if (std::strcmp(s, activation_name(a)) == 0) {
      *out = a;
      return true;
    }
  }
  return false;
}

/// f(std::integral_constant<Activation, a>{}): a run-time activation to a compile-time one.
template <class F>
inline decltype(auto) with_activation(Activation a, const F& f) {
  switch (a) {
    case Activation::gelu: return f(std::integral_constant<Activation, Activation::gelu>{});
    case Activation::gelu_tanh:
      return f(std::integral_constant<Activation, Activation::gelu_tanh>{});
    case Activation::swigluoai:
      return f(std::integral_constant<Activation, Activation::swigluoai>{});
    case Activation::silu: break;
  }
  return f(std::integral_constant<Activation, Activation::silu>{});
}

/// Where gate and up of output column i sit in a GEMM1 row of 2*I values.
struct GateUpLayout {
  int64_t gate_offset;  ///< gate[i] = row[gate_offset + i * stride]
  int64_t up_offset;    ///< up[i]   = row[up_offset + i * stride]
  int64_t stride;
};
inline GateUpLayout gate_up_layout(Activation a, int64_t inter) {
  if (a == Activation::swigluoai) return {0, 1, 2};
  return {0, inter, 1};
}

constexpr float kSwigluLimit = 7.0f;
constexpr float kSwigluAlpha = 1.702f;
constexpr float kGeluTanhC = 0.7978845608f;  // sqrt(2/pi)
constexpr float kGeluTanhA = 0.044715f;

namespace scalar {

inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }
inline float gelu_mul(float g, float u) {
  return 0.5f * g * (1.0f + std::erf(g * 0.70710678118654752f)) * u;
}
inline float gelu_tanh_mul(float g, float u) {
  return 0.5f * g * (1.0f + std::tanh(kGeluTanhC * (g + kGeluTanhA * g * g * g))) * u;
}
inline float swigluoai(float g, float u) {
  g = g > kSwigluLimit ? kSwigluLimit : g;  // ternaries keep NaN, as torch.clamp does
  u = u > kSwigluLimit ? kSwigluLimit : (u < -kSwigluLimit ? -kSwigluLimit : u);
  return (u + 1.0f) * g / (1.0f + std::exp(-kSwigluAlpha * g));
}
inline float apply(Activation a, float g, float u) {
  switch (a) {
    case Activation::silu: return silu_mul(g, u);
    case Activation::gelu: return gelu_mul(g, u);
    case Activation::gelu_tanh: return gelu_tanh_mul(g, u);
    case Activation::swigluoai: return swigluoai(g, u);
  }
  return 0.0f;
}

}  // namespace scalar

namespace vec {

/// e^x, branch-free: 2^n * p(r) with r = x - n ln2, degree-6 polynomial (about 2 ulp).
/// Inputs are clamped to [-87.3, 88.3] so the result stays finite and normal; NaN stays NaN.
inline float exp(float x) {
  x = x > 88.3f ? 88.3f : x;
  x = x < -87.3f ? -87.3f : x;
  // Round to nearest by the 1.5 * 2^23 trick: vectorizes without SSE4.1 / FRINTN.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693145751953125f;  // ln2 split in hi + lo for an exact reduction
  r = r - n * 1.42860682030941723e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t ni = static_cast<int32_t>(n == n ? n : 0.0f);  // NaN: defined cast, p stays NaN
  uint32_t bits = uint32_t(ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + vec::exp(-x)); }

/// erf(x), Abramowitz & Stegun 7.1.26, odd-symmetric: the formula is within 1.5e-7 of erf; its
/// fp32 evaluation within about 5e-7 (worst near |x| = 0.035), harmless where it is added to 1.
inline float erf(float x) {
  const float ax = std::fabs(x);
  const float t = 1.0f / (1.0f + 0.3275911f * ax);
  float p = 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  const float y = 1.0f - p * t * vec::exp(-ax * ax);
  return std::copysign(y, x);
}

/// tanh(x) = 1 - 2 / (e^{2x} + 1): absolute error about 1e-7, enough where it is added to 1.
inline float tanh(float x) { return 1.0f - 2.0f / (vec::exp(2.0f * x) + 1.0f); }

inline float silu_mul(float g, float u) { return g * vec::sigmoid(g) * u; }
inline float gelu_mul(float g, float u) {
  return 0.5f * g * (1.0f + vec::erf(g * 0.70710678118654752f)) * u;
}
inline float gelu_tanh_mul(float g, float u) {
  return 0.5f * g * (1.0f + vec::tanh(kGeluTanhC * (g + kGeluTanhA * g * g * g))) * u;
}
inline float swigluoai(float g, float u) {
  g = g > kSwigluLimit ? kSwigluLimit : g;
  u = u > kSwigluLimit ? kSwigluLimit : (u < -kSwigluLimit ? -kSwigluLimit : u);
  return (u + 1.0f) * g * vec::sigmoid(kSwigluAlpha * g);
}

/// One (gate, up) pair through activation @p a (for tests and scalar tails; loops use gated()).
inline float apply(Activation a, float g, float u) {
  switch (a) {
    case Activation::silu: return silu_mul(g, u);
    case Activation::gelu: return gelu_mul(g, u);
    case Activation::gelu_tanh: return gelu_tanh_mul(g, u);
    case Activation::swigluoai: return swigluoai(g, u);
  }
  return 0.0f;
}

#if defined(__aarch64__)
/// Four lanes of each per-element form above, operation for operation (so bit for bit equal):
/// a ternary clamp is FMIN / FMAX (both keep a NaN, as the ternaries do), the NaN-guarded int cast
/// is FCVTZS (which turns NaN into 0 by itself), copysign is a bit select, and two exact shortcuts
/// in exp (below).
namespace neon {

// Forced inline: called in loops, these must be inlined for the constants to be hoisted (GCC
// otherwise keeps exp() out of line and reloads its eleven constants at every call).
#define CPUMOE_NEON_INLINE inline __attribute__((always_inline))
// The same for a lambda handed to these loops (the sink of gated(), ...).
#define CPUMOE_NEON_INLINE_LAMBDA __attribute__((always_inline))

CPUMOE_NEON_INLINE float32x4_t exp(float32x4_t x) {
  x = vminq_f32(x, vdupq_n_f32(88.3f));
  x = vmaxq_f32(x, vdupq_n_f32(-87.3f));
  // FRINTN is the magic-number rounding exactly (|x log2 e| <= 128 here; NaN stays NaN).
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  float32x4_t r = vsubq_f32(x, vmulq_f32(n, vdupq_n_f32(0.693145751953125f)));
  r = vsubq_f32(r, vmulq_f32(n, vdupq_n_f32(1.42860682030941723e-06f)));
  float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
  p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(1.3981999507e-3f));
  p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(8.3334519073e-3f));
  p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(4.1665795894e-2f));
  p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(1.6666665459e-1f));
  p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(5.0000001201e-1f));
  p = vaddq_f32(vaddq_f32(vmulq_f32(vmulq_f32(p, r), r), r), vdupq_n_f32(1.0f));
  // (int(n) + 127) << 23 as int(n * 2^23) + (127 << 23): FCVTZS with 23 fraction bits.
  const int32x4_t n23 = vcvtq_n_s32_f32(n, 23);
  const float32x4_t scale = vreinterpretq_f32_s32(vaddq_s32(n23, vdupq_n_s32(127 << 23)));
  return vmulq_f32(p, scale);
}

CPUMOE_NEON_INLINE float32x4_t sigmoid(float32x4_t x) {
  const float32x4_t one = vdupq_n_f32(1.0f);
  return vdivq_f32(one, vaddq_f32(one, neon::exp(vnegq_f32(x))));
}

CPUMOE_NEON_INLINE float32x4_t erf(float32x4_t x) {
  const float32x4_t one = vdupq_n_f32(1.0f);
  const float32x4_t ax = vabsq_f32(x);
  const float32x4_t t = vdivq_f32(one, vaddq_f32(one, vmulq_f32(vdupq_n_f32(0.3275911f), ax)));
  float32x4_t p = vdupq_n_f32(1.061405429f);
  p = vsubq_f32(vmulq_f32(p, t), vdupq_n_f32(1.453152027f));
  p = vaddq_f32(vmulq_f32(p, t), vdupq_n_f32(1.421413741f));
  p = vsubq_f32(vmulq_f32(p, t), vdupq_n_f32(0.284496736f));
  p = vaddq_f32(vmulq_f32(p, t), vdupq_n_f32(0.254829592f));
  const float32x4_t y = vsubq_f32(one, vmulq_f32(vmulq_f32(p, t), neon::exp(vmulq_f32(vnegq_f32(ax), ax))));
  return vbslq_f32(vdupq_n_u32(0x80000000u), x, y);
}

CPUMOE_NEON_INLINE float32x4_t tanh(float32x4_t x) {
  const float32x4_t one = vdupq_n_f32(1.0f);
  return vsubq_f32(one, vdivq_f32(vdupq_n_f32(2.0f),
                                  vaddq_f32(neon::exp(vmulq_f32(vdupq_n_f32(2.0f), x)), one)));
}

CPUMOE_NEON_INLINE float32x4_t silu_mul(float32x4_t g, float32x4_t u) {
  return vmulq_f32(vmulq_f32(g, neon::sigmoid(g)), u);
}
CPUMOE_NEON_INLINE float32x4_t gelu_mul(float32x4_t g, float32x4_t u) {
  const float32x4_t e = neon::erf(vmulq_f32(g, vdupq_n_f32(0.70710678118654752f)));
  return vmulq_f32(vmulq_f32(vmulq_f32(vdupq_n_f32(0.5f), g), vaddq_f32(vdupq_n_f32(1.0f), e)), u);
}
CPUMOE_NEON_INLINE float32x4_t gelu_tanh_mul(float32x4_t g, float32x4_t u) {
  const float32x4_t cube = vmulq_f32(vmulq_f32(vmulq_f32(vdupq_n_f32(kGeluTanhA), g), g), g);
  const float32x4_t th = neon::tanh(vmulq_f32(vdupq_n_f32(kGeluTanhC), vaddq_f32(g, cube)));
  return vmulq_f32(vmulq_f32(vmulq_f32(vdupq_n_f32(0.5f), g), vaddq_f32(vdupq_n_f32(1.0f), th)), u);
}
CPUMOE_NEON_INLINE float32x4_t swigluoai(float32x4_t g, float32x4_t u) {
  const float32x4_t lim = vdupq_n_f32(kSwigluLimit);
  g = vminq_f32(g, lim);
  u = vmaxq_f32(vminq_f32(u, lim), vnegq_f32(lim));
  const float32x4_t s = neon::sigmoid(vmulq_f32(vdupq_n_f32(kSwigluAlpha), g));
  return vmulq_f32(vmulq_f32(vaddq_f32(u, vdupq_n_f32(1.0f)), g), s);
}

// sink(i, F(gate[i * stride], up[i * stride]) lanes i..i+3) for the leading multiple of 4 of n,
// stride 1 or 2 (ld2 deinterleaves; one ld2 when up follows gate); returns how many it did.
template <class F, class Sink>
CPUMOE_NEON_INLINE int64_t gated(const F& f, const float* gate, const float* up, int64_t stride, int64_t n,
                     const Sink& sink) {
  int64_t i = 0;
  if (stride == 1) {
    for (; i + 8 <= n; i += 8) {  // one ld1 of 8 floats from each half
      const float32x4x2_t g = vld1q_f32_x2(gate + i), u = vld1q_f32_x2(up + i);
      sink(i, f(g.val[0], u.val[0]));
      sink(i + 4, f(g.val[1], u.val[1]));
    }
    for (; i + 4 <= n; i += 4) sink(i, f(vld1q_f32(gate + i), vld1q_f32(up + i)));
  } else if (stride == 2 && up == gate + 1) {
    for (; i + 4 <= n; i += 4) {
      const float32x4x2_t gu = vld2q_f32(gate + 2 * i);
      sink(i, f(gu.val[0], gu.val[1]));
    }
  } else if (stride == 2) {
    for (; i + 4 <= n; i += 4) sink(i, f(vld2q_f32(gate + 2 * i).val[0], vld2q_f32(up + 2 * i).val[0]));
  }
  return i;
}

}  // namespace neon
#endif

/// The vector part of gated() below: sink(i, v) gets lanes i..i+3 of the result for a leading
/// multiple of 4 of n (none where there is no NEON form: the return value, how many, is then 0);
/// the caller does the rest with the per-element forms.
template <class Sink>
__attribute__((always_inline)) inline int64_t gated_vector_part(Activation a, const float* gate, const float* up, int64_t stride,
                                 int64_t n, const Sink& sink) {
#if defined(__aarch64__)
#define CPUMOE_NEON_GATED(fn) \
  return neon::gated([](float32x4_t g, float32x4_t u) CPUMOE_NEON_INLINE_LAMBDA { \
    return neon::fn(g, u);                                                          \
  }, gate, up, stride, n, sink)
  switch (a) {
    case Activation::silu: CPUMOE_NEON_GATED(silu_mul);
    case Activation::gelu: CPUMOE_NEON_GATED(gelu_mul);
    case Activation::gelu_tanh: CPUMOE_NEON_GATED(gelu_tanh_mul);
    case Activation::swigluoai: CPUMOE_NEON_GATED(swigluoai);
  }
#undef CPUMOE_NEON_GATED
#else
  (void)a, (void)gate, (void)up, (void)stride, (void)n, (void)sink;
#endif
  return 0;
}

/// out[i] = act(gate[i * stride], up[i * stride]) for i in [0, n). On AArch64, strides 1 and 2
/// (the two layouts of gate_up_layout) run through vec::neon four at a time; the rest is one
/// straight loop per activation.
inline void gated(Activation a, const float* gate, const float* up, int64_t stride, float* out,
                  int64_t n) {
#if defined(__aarch64__)
  const int64_t i0 = gated_vector_part(a, gate, up, stride, n,
                                       [out](int64_t i, float32x4_t v) CPUMOE_NEON_INLINE_LAMBDA {
                                         vst1q_f32(out + i, v);
                                       });
#else
  const int64_t i0 = gated_vector_part(a, gate, up, stride, n, nullptr);
#endif
  switch (a) {
    case Activation::silu:
      for (int64_t i = i0; i < n; ++i) out[i] = silu_mul(gate[i * stride], up[i * stride]);
      break;
    case Activation::gelu:
      for (int64_t i = i0; i < n; ++i) out[i] = gelu_mul(gate[i * stride], up[i * stride]);
      break;
    case Activation::gelu_tanh:
      for (int64_t i = i0; i < n; ++i) out[i] = gelu_tanh_mul(gate[i * stride], up[i * stride]);
      break;
    case Activation::swigluoai:
      for (int64_t i = i0; i < n; ++i) out[i] = swigluoai(gate[i * stride], up[i * stride]);
      break;
  }
}

/// Applies @p a to one GEMM1 row of 2 * @p inter values, writing @p inter values.
inline void gated_row(Activation a, const float* row, int64_t inter, float* out) {
  const GateUpLayout l = gate_up_layout(a, inter);
  gated(a, row + l.gate_offset, row + l.up_offset, l.stride, out, inter);
}

}  // namespace vec
}  // namespace cpumoe
