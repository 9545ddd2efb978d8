/// @file activation.h
/// The gated activations of the MoE op: one table (kActivationTable: name, gate/up layout,
/// parameters), a spec (an activation with its parameters, parsed from strings such as
/// "silu_clamp(limit=10)"), a scalar form (the textbook formula, std::erf / std::tanh /
/// std::exp) and a vector form (branch-free polynomial math over arrays, written so the compiler
/// vectorizes it for whatever ISA the including file is built for).
///
/// Header-only (CMake target cpumoe::activation). No ISA features needed. The polynomial math is
/// written once (vec::Math over a lane backend); the per-element vec:: forms are its one-lane
/// instance and the SIMD row operations (cpumoe/rowops.h) its vector instances, bit for bit equal.
///
/// Semantics, per element, with g the gate, u the up projection, L the limit, a the alpha:
///  - silu:            silu(g) * u = g / (1 + e^-g) * u
///  - gelu:            0.5 g (1 + erf(g / sqrt 2)) u
///  - gelu_tanh:       0.5 g (1 + tanh(0.7978845608 (g + 0.044715 g^3))) u
///  - swigluoai:       g' = min(g, L), u' = clamp(u, -L, L), (u' + 1) g' sigmoid(a g')
///                     (gpt-oss: L = 7, a = 1.702, the defaults)
///  - silu_clamp:      silu(min(g, L)) * clamp(u, -L, L)   (DeepSeek-V4, GLM5-Next, HY-V4)
///  - silu_clamp_post: min(silu(g), L) * clamp(u, -L, L)   (Step3p7)
/// Every clamp keeps NaN (as torch.clamp does); L = +inf clamps nothing. Where gate and up live in
/// a row of GEMM1's output [2I] is the table's choice (see gate_up_layout()): halves, or even/odd
/// columns for swigluoai.
///
/// Adding an activation: a row of kActivationTable, an enumerator, a branch of Math::activate
/// (and of scalar::apply); every op, format, kernel path, binding and the Python package (which
/// reads the table through cpumoe._C.activations()) then take it.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

namespace cpumoe {

enum class Activation : int {
  silu = 0,
  gelu = 1,
  gelu_tanh = 2,
  swigluoai = 3,
  silu_clamp = 4,
  silu_clamp_post = 5,
};

constexpr float kSwigluLimit = 7.0f;
constexpr float kSwigluAlpha = 1.702f;
constexpr float kGeluTanhC = 0.7978845608f;  // sqrt(2/pi)
constexpr float kGeluTanhA = 0.044715f;
/// A parameter with no default: it must be given (a NaN never passes validation).
constexpr float kRequired = std::numeric_limits<float>::quiet_NaN();

/// One row of the activation table.
struct ActivationInfo {
  Activation kind;
  const char* name;
  bool interleaved;     ///< gate and up at even / odd columns of a GEMM1 row (else halves)
  bool has_limit;       ///< takes limit= (the clamp L, > 0, +inf allowed)
  bool has_alpha;       ///< takes alpha= (finite)
  float default_limit;  ///< kRequired: no default
  float default_alpha;
  const char* formula;  ///< for messages and cpumoe._C.activations()
};

/// Every activation of the op, in enum order.
inline constexpr ActivationInfo kActivationTable[] = {
    {Activation::silu, "silu", false, false, false, 0.0f, 0.0f, "silu(g) * u"},
    {Activation::gelu, "gelu", false, false, false, 0.0f, 0.0f, "gelu(g) * u (erf form)"},
    {Activation::gelu_tanh, "gelu_tanh", false, false, false, 0.0f, 0.0f,
     "gelu_tanh(g) * u (tanh approximation)"},
    {Activation::swigluoai, "swigluoai", true, true, true, kSwigluLimit, kSwigluAlpha,
     "(clamp(u, -L, L) + 1) * g' * sigmoid(alpha * g'), g' = min(g, L); gate/up interleaved"},
    {Activation::silu_clamp, "silu_clamp", false, true, false, kRequired, 0.0f,
     "silu(min(g, L)) * clamp(u, -L, L)"},
    {Activation::silu_clamp_post, "silu_clamp_post", false, true, false, kRequired, 0.0f,
     "min(silu(g), L) * clamp(u, -L, L)"},
};
inline constexpr int kNumActivations = int(sizeof(kActivationTable) / sizeof(kActivationTable[0]));

constexpr const ActivationInfo& activation_info(Activation a) {
  const int i = int(a);
  return kActivationTable[i >= 0 && i < kNumActivations ? i : 0];
}
inline const char* activation_name(Activation a) {
  const int i = int(a);
  return i >= 0 && i < kNumActivations ? kActivationTable[i].name : "?";
}

/// Parses a bare activation name ("silu", ..., see kActivationTable). False for anything else.
inline bool parse_activation(const char* s, Activation* out) {
  for (const ActivationInfo& info : kActivationTable) {
    if (std::strcmp(s, info.name) == 0) {
      *out = info.kind;
      return true;
    }
  }
  return false;
}

/// An activation with its parameters. Built from an Activation alone it has the table's
/// defaults (kRequired, a NaN, where there is none: validate_activation() then refuses it).
/// Parameters the activation does not take are ignored by the math.
struct ActivationSpec {
  Activation kind = Activation::silu;
  float limit = 0.0f;
  float alpha = 0.0f;

  constexpr ActivationSpec() = default;
  constexpr ActivationSpec(Activation k)  // NOLINT: implicit, an Activation is its default spec
      : kind(k), limit(activation_info(k).default_limit), alpha(activation_info(k).default_alpha) {}
  constexpr ActivationSpec(Activation k, float lim, float a) : kind(k), limit(lim), alpha(a) {}
  /// With only the limit (silu_clamp, silu_clamp_post; swigluoai with its default alpha).
  static ActivationSpec with_limit(Activation k, float lim) {
    ActivationSpec s(k);
    s.limit = lim;
    return s;
  }
};

/// Empty if @p s can run: its limit is > 0 (+inf allowed) and its alpha finite, where the
/// activation takes them; else why not.
inline std::string activation_spec_problem(const ActivationSpec& s) {
  const ActivationInfo& info = activation_info(s.kind);
  if (info.has_limit && !(s.limit > 0.0f))
    return std::string(info.name) +
           (std::isnan(s.limit) ? " needs limit=L (the clamp, > 0)"
                                : ": limit must be > 0, got " + std::to_string(s.limit));
  if (info.has_alpha && !std::isfinite(s.alpha))
    return std::string(info.name) + ": alpha must be finite";
  return {};
}

/// The canonical text of a spec: the bare name when every parameter is the default, else
/// name(limit=L,alpha=A) with the parameters the activation takes (floats at 9 significant
/// digits: they parse back to the same float).
inline std::string activation_spec_str(const ActivationSpec& s) {
  const ActivationInfo& info = activation_info(s.kind);
  auto same = [](float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); };
  const bool defaults = (!info.has_limit || same(s.limit, info.default_limit)) &&
                        (!info.has_alpha || same(s.alpha, info.default_alpha));
  std::string out = info.name;
  if (defaults) return out;
  char buf[64];
  out += "(";
  if (info.has_limit) {
    std::snprintf(buf, sizeof buf, "limit=%.9g", double(s.limit));
    out += buf;
  }
  if (info.has_alpha) {
    std::snprintf(buf, sizeof buf, "%salpha=%.9g", info.has_limit ? "," : "", double(s.alpha));
    out += buf;
  }
  return out + ")";
}

/// Parses "name" or "name(key=value, ...)" with keys limit / alpha (those the activation takes;
/// each at most once; values as std::from_chars reads them, "inf" allowed for limit). On failure returns
/// false and says why in @p why (if not null); @p out is then untouched. A spec that parses may
/// still fail activation_spec_problem() (a required limit missing, a limit <= 0).
inline bool parse_activation_spec(const std::string& text, ActivationSpec* out,
                                  std::string* why = nullptr) {
  auto fail = [&](const std::string& m) {
    if (why) *why = m;
    return false;
  };
  const size_t open = text.find('(');
  const std::string name = text.substr(0, open);
  Activation kind;
  if (!parse_activation(name.c_str(), &kind)) {
    std::string names;
    for (const ActivationInfo& info : kActivationTable) names += (names.empty() ? "" : ", ") +
                                                                  std::string(info.name);
    return fail("unknown activation '" + name + "' (cpumoe has " + names + ")");
  }
  ActivationSpec spec(kind);
  const ActivationInfo& info = activation_info(kind);
  if (open != std::string::npos) {
    if (text.back() != ')') return fail("'" + text + "': expected name(key=value, ...)");
    std::string body = text.substr(open + 1, text.size() - open - 2);
    bool seen_limit = false, seen_alpha = false;
    size_t pos = 0;
    while (pos <= body.size()) {
      size_t comma = body.find(',', pos);
      if (comma == std::string::npos) comma = body.size();
      std::string item = body.substr(pos, comma - pos);
      pos = comma + 1;
      const size_t b = item.find_first_not_of(' '), e = item.find_last_not_of(' ');
      if (b == std::string::npos) {
        if (comma == body.size() && body.find_first_not_of(' ') == std::string::npos) break;
        return fail("'" + text + "': an empty parameter");
      }
      item = item.substr(b, e - b + 1);
      const size_t eq = item.find('=');
      if (eq == std::string::npos) return fail("'" + text + "': expected key=value, got '" + item + "'");
      std::string key = item.substr(0, eq), val = item.substr(eq + 1);
      while (!key.empty() && key.back() == ' ') key.pop_back();
      while (!val.empty() && val.front() == ' ') val.erase(val.begin());
      // from_chars: the C locale's number syntax whatever the process's locale (strtof would
      // stop at the '.' of "1.5" under a locale with a decimal comma); a leading '+' allowed.
      float v = 0.0f;
      const char* first = val.data() + (!val.empty() && val[0] == '+' ? 1 : 0);
      const char* last = val.data() + val.size();
      const std::from_chars_result r = std::from_chars(first, last, v);
      if (val.empty() || r.ptr != last ||
          (r.ec != std::errc() && r.ec != std::errc::result_out_of_range))
        return fail("'" + text + "': " + key + " is not a number ('" + val + "')");
      if (r.ec == std::errc::result_out_of_range)  // past the float range: +-inf or 0 as strtof
        v = std::strtof(std::string(first, last).c_str(), nullptr);
      if (key == "limit" && info.has_limit && !seen_limit) {
        spec.limit = v;
        seen_limit = true;
      } else if (key == "alpha" && info.has_alpha && !seen_alpha) {
        spec.alpha = v;
        seen_alpha = true;
      } else if ((key == "limit" && seen_limit) || (key == "alpha" && seen_alpha)) {
        return fail("'" + text + "': " + key + " given twice");
      } else {
        std::string takes;
        if (info.has_limit) takes += "limit";
        if (info.has_alpha) takes += takes.empty() ? "alpha" : ", alpha";
        return fail("'" + text + "': " + info.name + " takes " +
                    (takes.empty() ? std::string("no parameters") : takes) + ", not " + key);
      }
      if (comma == body.size()) break;
    }
  }
  *out = spec;
  return true;
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
    case Activation::silu_clamp:
      return f(std::integral_constant<Activation, Activation::silu_clamp>{});
    case Activation::silu_clamp_post:
      return f(std::integral_constant<Activation, Activation::silu_clamp_post>{});
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
/// Whether gate and up are interleaved (even / odd columns) for @p a; compile-time where a is.
constexpr bool interleaved_gate_up(Activation a) { return activation_info(a).interleaved; }
inline GateUpLayout gate_up_layout(Activation a, int64_t inter) {
  if (interleaved_gate_up(a)) return {0, 1, 2};
  return {0, inter, 1};
}

namespace scalar {

// Ternary clamps keep NaN, as torch.clamp does.
inline float min_keep_nan(float c, float x) { return x > c ? c : x; }
inline float clamp_keep_nan(float x, float l) { return x > l ? l : (x < -l ? -l : x); }

inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }
inline float gelu_mul(float g, float u) {
  return 0.5f * g * (1.0f + std::erf(g * 0.70710678118654752f)) * u;
}
inline float gelu_tanh_mul(float g, float u) {
  return 0.5f * g * (1.0f + std::tanh(kGeluTanhC * (g + kGeluTanhA * g * g * g))) * u;
}
inline float swigluoai(float g, float u, float limit = kSwigluLimit, float alpha = kSwigluAlpha) {
  g = min_keep_nan(limit, g);
  u = clamp_keep_nan(u, limit);
  return (u + 1.0f) * g / (1.0f + std::exp(-alpha * g));
}
inline float silu_clamp(float g, float u, float limit) {
  return silu_mul(min_keep_nan(limit, g), clamp_keep_nan(u, limit));
}
inline float silu_clamp_post(float g, float u, float limit) {
  return min_keep_nan(limit, g / (1.0f + std::exp(-g))) * clamp_keep_nan(u, limit);
}
inline float apply(const ActivationSpec& a, float g, float u) {
  switch (a.kind) {
    case Activation::silu: return silu_mul(g, u);
    case Activation::gelu: return gelu_mul(g, u);
    case Activation::gelu_tanh: return gelu_tanh_mul(g, u);
    case Activation::swigluoai: return swigluoai(g, u, a.limit, a.alpha);
    case Activation::silu_clamp: return silu_clamp(g, u, a.limit);
    case Activation::silu_clamp_post: return silu_clamp_post(g, u, a.limit);
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

  /// act(g, u) for the gated activation A (the semantics at the top of this file) with the
  /// spec's parameters (read only by the activations that take them).
  template <Activation A>
  static CPUMOE_ACT_INLINE V activate(V g, V u, const ActivationSpec& p) {
    if constexpr (A == Activation::silu) {
      return B::mul(B::mul(g, sigmoid(g)), u);
    } else if constexpr (A == Activation::gelu) {
      const V e = erf(B::mul(g, B::splat(0.70710678118654752f)));
      return B::mul(B::mul(B::mul(B::splat(0.5f), g), B::add(B::splat(1.0f), e)), u);
    } else if constexpr (A == Activation::gelu_tanh) {
      const V cube = B::mul(B::mul(B::mul(B::splat(kGeluTanhA), g), g), g);
      const V th = tanh(B::mul(B::splat(kGeluTanhC), B::add(g, cube)));
      return B::mul(B::mul(B::mul(B::splat(0.5f), g), B::add(B::splat(1.0f), th)), u);
    } else if constexpr (A == Activation::swigluoai) {
      const V lim = B::splat(p.limit);
      g = B::min(lim, g);
      u = B::max(B::splat(-p.limit), B::min(lim, u));
      return B::mul(B::mul(B::add(u, B::splat(1.0f)), g), sigmoid(B::mul(B::splat(p.alpha), g)));
    } else if constexpr (A == Activation::silu_clamp) {
      const V lim = B::splat(p.limit);
      g = B::min(lim, g);
      u = B::max(B::splat(-p.limit), B::min(lim, u));
      return B::mul(B::mul(g, sigmoid(g)), u);
    } else {
      static_assert(A == Activation::silu_clamp_post, "an activation without its math");
      const V lim = B::splat(p.limit);
      u = B::max(B::splat(-p.limit), B::min(lim, u));
      return B::mul(B::min(lim, B::mul(g, sigmoid(g))), u);
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

inline float silu_mul(float g, float u) {
  return Math<Scalar>::activate<Activation::silu>(g, u, {});
}
inline float gelu_mul(float g, float u) {
  return Math<Scalar>::activate<Activation::gelu>(g, u, {});
}
inline float gelu_tanh_mul(float g, float u) {
  return Math<Scalar>::activate<Activation::gelu_tanh>(g, u, {});
}
inline float swigluoai(float g, float u, float limit = kSwigluLimit, float alpha = kSwigluAlpha) {
  return Math<Scalar>::activate<Activation::swigluoai>(g, u, {Activation::swigluoai, limit, alpha});
}

/// One (gate, up) pair through activation @p A with @p p's parameters (for tests and scalar
/// tails).
template <Activation A>
CPUMOE_ACT_INLINE float apply(float g, float u, const ActivationSpec& p) {
  return Math<Scalar>::activate<A>(g, u, p);
}
inline float apply(const ActivationSpec& a, float g, float u) {
  return with_activation(a.kind, [&](auto kAct) { return apply<kAct()>(g, u, a); });
}

/// out[i] = act(gate[i * stride], up[i * stride]) for i in [0, n), one straight loop per
/// activation. (The optimised row forms are the RowOps variants of cpumoe/rowops.h.)
inline void gated(const ActivationSpec& a, const float* gate, const float* up, int64_t stride,
                  float* out, int64_t n) {
  with_activation(a.kind, [&](auto kAct) {
    for (int64_t i = 0; i < n; ++i) out[i] = apply<kAct()>(gate[i * stride], up[i * stride], a);
  });
}

/// Applies @p a to one GEMM1 row of 2 * @p inter values, writing @p inter values.
inline void gated_row(const ActivationSpec& a, const float* row, int64_t inter, float* out) {
  const GateUpLayout l = gate_up_layout(a.kind, inter);
  gated(a, row + l.gate_offset, row + l.up_offset, l.stride, out, inter);
}

}  // namespace vec
}  // namespace cpumoe
