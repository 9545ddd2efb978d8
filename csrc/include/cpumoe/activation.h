/// @file activation.h
/// The four gated activations of the MoE op, in a scalar form (the textbook formula, std::erf /
/// std::tanh / std::exp) and a vector form (branch-free polynomial math over arrays, written so the
/// compiler vectorizes it for whatever ISA the including file is built for).
///
/// Header-only (CMake target cpumoe::activation). No ISA features needed. The polynomial math is
/// written once (vec::Math over a lane backend); the per-element vec:: forms are its one-lane
/// instance and the SIMD row operations (cpumoe/rowops.h) its vector instances, bit for bit equal.
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

// Forced inline: the math below is called in loops and must be inlined for its constants to be
// hoisted (GCC otherwise keeps exp() out of line and reloads its eleven constants at every call).
#define CPUMOE_ACT_INLINE inline __attribute__((always_inline))
// The same for a lambda handed to such loops (a row loop's sink).
#define CPUMOE_ACT_INLINE_LAMBDA __attribute__((always_inline))

/// The polynomial activation math, written once over a lane backend B: the per-element vec::
/// forms below are Math<Scalar>, and the vector row operations (csrc/ukernels/rowops) use the
/// same template over their SIMD backends, so every form runs the same IEEE operations in the
/// same order (the build disables FMA contraction) and gives the same bits.
/// B provides (static): V; splat, add, sub, mul, div; min(c, x) and max(c, x) (x when x is NaN,
/// as the ternary clamps `x > c ? c : x` do); neg, abs, copysign(mag, sgn); rint(v) (round to
/// nearest even, |v| <= 2^22, NaN stays NaN: the 1.5 * 2^23 magic-number rounding); pow2i(n)
/// (2^n for integral n in [-127, 128], 1.0 for NaN).
template <class B>
struct Math {
  using V = typename B::V;

  /// e^x, branch-free: 2^n * p(r) with r = x - n ln2, degree-6 polynomial (about 2 ulp).
  /// Inputs are clamped to [-87.3, 88.3] so the result stays finite and normal; NaN stays NaN.
  static CPUMOE_ACT_INLINE V exp(V x) {
    x = B::min(B::splat(88.3f), x);
    x = B::max(B::splat(-87.3f), x);
    const V n = B::rint(B::mul(x, B::splat(1.44269504088896341f)));
    V r = B::sub(x, B::mul(n, B::splat(0.693145751953125f)));  // ln2 in hi + lo: exact reduction
    r = B::sub(r, B::mul(n, B::splat(1.42860682030941723e-06f)));
    V p = B::splat(1.9875691500e-4f);
    p = B::add(B::mul(p, r), B::splat(1.3981999507e-3f));
    p = B::add(B::mul(p, r), B::splat(8.3334519073e-3f));
    p = B::add(B::mul(p, r), B::splat(4.1665795894e-2f));
    p = B::add(B::mul(p, r), B::splat(1.6666665459e-1f));
    p = B::add(B::mul(p, r), B::splat(5.0000001201e-1f));
    p = B::add(B::add(B::mul(B::mul(p, r), r), r), B::splat(1.0f));
    return B::mul(p, B::pow2i(n));  // a NaN n keeps p NaN
  }

  static CPUMOE_ACT_INLINE V sigmoid(V x) {
    const V one = B::splat(1.0f);
    return B::div(one, B::add(one, exp(B::neg(x))));
  }

  /// erf(x), Abramowitz & Stegun 7.1.26, odd-symmetric: the formula is within 1.5e-7 of erf; its
  /// fp32 evaluation within about 5e-7 (worst near |x| = 0.035), harmless where it is added to 1.
  static CPUMOE_ACT_INLINE V erf(V x) {
    const V one = B::splat(1.0f);
    const V ax = B::abs(x);
    const V t = B::div(one, B::add(one, B::mul(B::splat(0.3275911f), ax)));
    V p = B::splat(1.061405429f);
    p = B::sub(B::mul(p, t), B::splat(1.453152027f));
    p = B::add(B::mul(p, t), B::splat(1.421413741f));
    p = B::sub(B::mul(p, t), B::splat(0.284496736f));
    p = B::add(B::mul(p, t), B::splat(0.254829592f));
    const V y = B::sub(one, B::mul(B::mul(p, t), exp(B::mul(B::neg(ax), ax))));
    return B::copysign(y, x);
  }

  /// tanh(x) = 1 - 2 / (e^{2x} + 1): absolute error about 1e-7, enough where it is added to 1.
  static CPUMOE_ACT_INLINE V tanh(V x) {
    const V one = B::splat(1.0f);
    return B::sub(one, B::div(B::splat(2.0f), B::add(exp(B::mul(B::splat(2.0f), x)), one)));
  }

  /// act(g, u) for the gated activation A (the semantics at the top of this file).
  template <Activation A>
  static CPUMOE_ACT_INLINE V activate(V g, V u) {
    if constexpr (A == Activation::silu) {
      return B::mul(B::mul(g, sigmoid(g)), u);
    } else if constexpr (A == Activation::gelu) {
      const V e = erf(B::mul(g, B::splat(0.70710678118654752f)));
      return B::mul(B::mul(B::mul(B::splat(0.5f), g), B::add(B::splat(1.0f), e)), u);
    } else if constexpr (A == Activation::gelu_tanh) {
      const V cube = B::mul(B::mul(B::mul(B::splat(kGeluTanhA), g), g), g);
      const V th = tanh(B::mul(B::splat(kGeluTanhC), B::add(g, cube)));
      return B::mul(B::mul(B::mul(B::splat(0.5f), g), B::add(B::splat(1.0f), th)), u);
    } else {
      const V lim = B::splat(kSwigluLimit);
      g = B::min(lim, g);
      u = B::max(B::splat(-kSwigluLimit), B::min(lim, u));
      return B::mul(B::mul(B::add(u, B::splat(1.0f)), g), sigmoid(B::mul(B::splat(kSwigluAlpha), g)));
    }
  }
};

/// The one-lane backend of Math: plain fp32 operations, the definition of the vector forms.
struct Scalar {
  using V = float;
  static CPUMOE_ACT_INLINE V splat(float f) { return f; }
  static CPUMOE_ACT_INLINE V add(V a, V b) { return a + b; }
  static CPUMOE_ACT_INLINE V sub(V a, V b) { return a - b; }
  static CPUMOE_ACT_INLINE V mul(V a, V b) { return a * b; }
  static CPUMOE_ACT_INLINE V div(V a, V b) { return a / b; }
  static CPUMOE_ACT_INLINE V min(V c, V x) { return x > c ? c : x; }
  static CPUMOE_ACT_INLINE V max(V c, V x) { return x < c ? c : x; }
  static CPUMOE_ACT_INLINE V neg(V x) { return -x; }
  static CPUMOE_ACT_INLINE V abs(V x) { return std::fabs(x); }
  static CPUMOE_ACT_INLINE V copysign(V mag, V sgn) { return std::copysign(mag, sgn); }
  // The 1.5 * 2^23 trick: vectorizes without SSE4.1 / FRINTN.
  static CPUMOE_ACT_INLINE V rint(V v) { return (v + 12582912.0f) - 12582912.0f; }
  static CPUMOE_ACT_INLINE V pow2i(V n) {
    const int32_t ni = static_cast<int32_t>(n == n ? n : 0.0f);  // NaN: a defined cast
    const uint32_t bits = uint32_t(ni + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return scale;
  }
};

inline float exp(float x) { return Math<Scalar>::exp(x); }
inline float sigmoid(float x) { return Math<Scalar>::sigmoid(x); }
inline float erf(float x) { return Math<Scalar>::erf(x); }
inline float tanh(float x) { return Math<Scalar>::tanh(x); }

inline float silu_mul(float g, float u) { return Math<Scalar>::activate<Activation::silu>(g, u); }
inline float gelu_mul(float g, float u) { return Math<Scalar>::activate<Activation::gelu>(g, u); }
inline float gelu_tanh_mul(float g, float u) {
  return Math<Scalar>::activate<Activation::gelu_tanh>(g, u);
}
inline float swigluoai(float g, float u) {
  return Math<Scalar>::activate<Activation::swigluoai>(g, u);
}

/// One (gate, up) pair through activation @p a (for tests and scalar tails).
template <Activation A>
CPUMOE_ACT_INLINE float apply(float g, float u) {
  return Math<Scalar>::activate<A>(g, u);
}
inline float apply(Activation a, float g, float u) {
  return with_activation(a, [&](auto kAct) { return apply<kAct()>(g, u); });
}

/// out[i] = act(gate[i * stride], up[i * stride]) for i in [0, n), one straight loop per
/// activation. (The optimised row forms are the RowOps variants of cpumoe/rowops.h.)
inline void gated(Activation a, const float* gate, const float* up, int64_t stride, float* out,
                  int64_t n) {
  with_activation(a, [&](auto kAct) {
    for (int64_t i = 0; i < n; ++i) out[i] = apply<kAct()>(gate[i * stride], up[i * stride]);
  });
}

/// Applies @p a to one GEMM1 row of 2 * @p inter values, writing @p inter values.
inline void gated_row(Activation a, const float* row, int64_t inter, float* out) {
  const GateUpLayout l = gate_up_layout(a, inter);
  gated(a, row + l.gate_offset, row + l.up_offset, l.stride, out, inter);
}

}  // namespace vec
}  // namespace cpumoe
