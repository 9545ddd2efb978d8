// The row operations (cpumoe/rowops.h) written once over an x86 vector backend B: the AVX-512
// (rowops_avx512.cpp, 16 lanes, masked tails) and AVX2 (rowops_avx2.cpp, 8 lanes, tails through
// a stack buffer) variants differ only in B. The bits are those of the scalar definitions:
//  - every arithmetic step is the scalar form's IEEE operation in the same order (no FMA, no
//    reciprocal approximations: a division stays a division);
//  - a ternary clamp `x > c ? c : x` is min(c, x) and `x < c ? c : x` is max(c, x): VMINPS /
//    VMAXPS return their second operand when either is NaN, as the ternaries keep x;
//  - the absolute maximum is an unsigned max of |x|'s bits (the order of non-negative floats), and
//    a row with a NaN falls back to the scalar rule for the exact NaN the scalar code returns;
//  - rounding to int8 rounds to nearest even in the instruction (independent of MXCSR), which is
//    the scalar magic-number rounding for |v| <= 128; a non-finite scale (inf or NaN amax)
//    quantizes every element to 0, as x / s does in the scalar form;
//  - bf16 rounding is the integer rule of dtype.h; f16 is VCVTPS2PH (IEEE round to nearest even,
//    subnormals, overflow to inf) with NaN lanes set to sign | 0x7e00 as f32_to_f16 does.
// Lanes past a row's end load as +0 and are never stored; every activation maps (0, 0) to +0, so
// they never raise a row's absolute maximum.
//
// The backend B provides (all static): V, VI (fp32 / int32 vectors), H (kLanes 16-bit values),
// Tail (which lanes of a chunk are real: tail(r) for r >= 1 remaining elements), kLanes; splat,
// add, sub, mul, div, min, max; bits, from_bits, seti, and_, or_, xor_, addi, srli<N>, slli<N>,
// max_u32, min_i32, max_i32, reduce_max_u32; nan_select(v, if_number, if_nan) (int lanes picked by
// whether v is NaN), cvtt_or_zero (truncate, NaN -> 0), cvt_rne (to int32, nearest even),
// copysign(mag, sgn); deinterleave(lo, hi, &even, &odd) (of 2 kLanes floats); loads load_f32,
// load_h; stores store_f32, store_h, store_i8 (int32 lanes, already in [-127, 127]);
// widen_bf16(H) (bf16 bits to fp32), narrow_high(VI) (high halves to H), f16_from(V) (VCVTPS2PH,
// nearest even), f32_from_f16(H), f16_nan_fix(H, V) (NaN lanes of V to sign | 0x7e00).
//
// Internal linkage on purpose: each variant's file instantiates these with its own ISA flags.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpumoe/quantize.h"  // the scalar definitions (NaN fallbacks, slot-count dispatch)
#include "cpumoe/rowops.h"

namespace cpumoe {
namespace {
namespace rowops_x86 {

#define CPUMOE_X86_INLINE inline __attribute__((always_inline))
#define CPUMOE_X86_INLINE_LAMBDA __attribute__((always_inline))

template <class B>
struct Algo {
  using V = typename B::V;
  using VI = typename B::VI;
  using H = typename B::H;
  using Tail = typename B::Tail;
  static constexpr int64_t kLanes = B::kLanes;

  static CPUMOE_X86_INLINE V neg(V x) { return B::from_bits(B::xor_(B::bits(x), B::seti(int32_t(0x80000000u)))); }
  static CPUMOE_X86_INLINE VI abs_bits(V x) { return B::and_(B::bits(x), B::seti(0x7fffffff)); }

  // --- The activations: vec:: of activation.h, operation for operation ----------------------

  static CPUMOE_X86_INLINE V exp(V x) {
    x = B::min(B::splat(88.3f), x);
    x = B::max(B::splat(-87.3f), x);
    const V magic = B::splat(12582912.0f);
    const V n = B::sub(B::add(B::mul(x, B::splat(1.44269504088896341f)), magic), magic);
    V r = B::sub(x, B::mul(n, B::splat(0.693145751953125f)));
    r = B::sub(r, B::mul(n, B::splat(1.42860682030941723e-06f)));
    V p = B::splat(1.9875691500e-4f);
    p = B::add(B::mul(p, r), B::splat(1.3981999507e-3f));
    p = B::add(B::mul(p, r), B::splat(8.3334519073e-3f));
    p = B::add(B::mul(p, r), B::splat(4.1665795894e-2f));
    p = B::add(B::mul(p, r), B::splat(1.6666665459e-1f));
    p = B::add(B::mul(p, r), B::splat(5.0000001201e-1f));
    p = B::add(B::add(B::mul(B::mul(p, r), r), r), B::splat(1.0f));
    // int(n), NaN -> 0 as the scalar's guarded cast (n is integral and |n| <= 127 otherwise).
    const V scale = B::from_bits(B::template slli<23>(B::addi(B::cvtt_or_zero(n), B::seti(127))));
    return B::mul(p, scale);
  }

  static CPUMOE_X86_INLINE V sigmoid(V x) {
    const V one = B::splat(1.0f);
    return B::div(one, B::add(one, exp(neg(x))));
  }

  static CPUMOE_X86_INLINE V erf(V x) {
    const V one = B::splat(1.0f);
    const V ax = B::from_bits(abs_bits(x));
    const V t = B::div(one, B::add(one, B::mul(B::splat(0.3275911f), ax)));
    V p = B::splat(1.061405429f);
    p = B::sub(B::mul(p, t), B::splat(1.453152027f));
    p = B::add(B::mul(p, t), B::splat(1.421413741f));
    p = B::sub(B::mul(p, t), B::splat(0.284496736f));
    p = B::add(B::mul(p, t), B::splat(0.254829592f));
    const V y = B::sub(one, B::mul(B::mul(p, t), exp(B::mul(neg(ax), ax))));
    return B::copysign(y, x);
  }

  static CPUMOE_X86_INLINE V tanh(V x) {
    const V one = B::splat(1.0f);
    return B::sub(one, B::div(B::splat(2.0f), B::add(exp(B::mul(B::splat(2.0f), x)), one)));
  }

  template <Activation A>
  static CPUMOE_X86_INLINE V activate(V g, V u) {
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
      u = B::min(lim, B::max(B::splat(-kSwigluLimit), u));
      return B::mul(B::mul(B::add(u, B::splat(1.0f)), g), sigmoid(B::mul(B::splat(kSwigluAlpha), g)));
    }
  }

  // sink(i, tail, act(gate, up) of lanes i..) over a GEMM1 row of 2 * inter values, in the layout
  // of gate_up_layout(A): halves, or (swigluoai) gate and up interleaved.
  template <Activation A, class Sink>
  static CPUMOE_X86_INLINE void gated_row(const float* row, int64_t inter, const Sink& sink) {
    for (int64_t i = 0; i < inter; i += kLanes) {
      const Tail t = B::tail(inter - i);
      if constexpr (A == Activation::swigluoai) {
        const int64_t r = 2 * (inter - i);  // floats left in the row
        const V lo = B::load_f32(row + 2 * i, B::tail(r));
        const V hi = r > kLanes ? B::load_f32(row + 2 * i + kLanes, B::tail(r - kLanes)) : B::splat(0.0f);
        V g, u;
        B::deinterleave(lo, hi, &g, &u);
        sink(i, t, activate<A>(g, u));
      } else {
        sink(i, t, activate<A>(B::load_f32(row + i, t), B::load_f32(row + inter + i, t)));
      }
    }
  }

  // --- dtype conversions --------------------------------------------------------------------

  template <DType D>
  static CPUMOE_X86_INLINE V load(const void* x, int64_t i, Tail t) {
    if constexpr (D == DType::f32) {
      return B::load_f32(static_cast<const float*>(x) + i, t);
    } else {
      const H h = B::load_h(static_cast<const uint16_t*>(x) + i, t);
      if constexpr (D == DType::bf16) return B::widen_bf16(h);
      return B::f32_from_f16(h);
    }
  }

  // f32_to_bf16 of each lane, in the high half (low half zero).
  static CPUMOE_X86_INLINE VI bf16_bits_high(V v) {
    const VI u = B::bits(v);
    const VI lsb = B::and_(B::template srli<16>(u), B::seti(1));
    const VI r = B::addi(B::addi(u, B::seti(0x7fff)), lsb);
    const VI quiet = B::or_(u, B::seti(0x400000));  // NaN stays a quiet NaN
    return B::and_(B::nan_select(v, r, quiet), B::seti(int32_t(0xffff0000u)));
  }

  // f32_to_f16 of each lane.
  static CPUMOE_X86_INLINE H f16_bits(V v) { return B::f16_nan_fix(B::f16_from(v), v); }

  // round_to_dtype(v, D), lane-wise.
  template <DType D>
  static CPUMOE_X86_INLINE V round_to(V v) {
    if constexpr (D == DType::bf16) return B::from_bits(bf16_bits_high(v));
    if constexpr (D == DType::f16) return B::f32_from_f16(f16_bits(v));
    return v;
  }

  // Stores the real lanes of v at element i of dst in dtype dt (rounding to nearest even).
  static CPUMOE_X86_INLINE void store(V v, DType dt, void* dst, int64_t i, Tail t) {
    if (dt == DType::f32) B::store_f32(static_cast<float*>(dst) + i, t, v);
    else if (dt == DType::bf16) B::store_h(static_cast<uint16_t*>(dst) + i, t, B::narrow_high(bf16_bits_high(v)));
    else B::store_h(static_cast<uint16_t*>(dst) + i, t, f16_bits(v));
  }

  // --- quantization -------------------------------------------------------------------------

  // The scalar amax of a row (the NaN it returns is the last NaN met, as amax_step has it).
  template <DType D>
  static float scalar_amax(const void* x, int64_t n) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = rowops::amax_step(amax, std::fabs(load_as_f32(x, D, i)));
    return amax;
  }

  // The row's amax from the unsigned max of |x| bits: exact unless a NaN is among them.
  template <DType D>
  static float amax_from(VI m, const void* x, int64_t n) {
    const uint32_t b = B::reduce_max_u32(m);
    if (b > 0x7f800000u) return scalar_amax<D>(x, n);
    float a;
    std::memcpy(&a, &b, 4);
    return a;
  }

  template <DType D>
  static float quantize_with_amax(const void* x, int64_t n, float amax, int8_t* q) {
    // NaN stays NaN (std::max keeps its first argument), an inf gives an inf scale.
    const float s = std::max(amax, kAmaxFloor) / 127.0f;
    if (!(std::fabs(s) <= 3.4028235e38f)) {  // x / s is 0 or NaN for every x: all quantize to 0
      std::memset(q, 0, size_t(n));
      return s;
    }
    const V sv = B::splat(s);
    const VI hi = B::seti(127), lo = B::seti(-127);
    for (int64_t i = 0; i < n; i += kLanes) {
      const Tail t = B::tail(n - i);
      const VI r = B::cvt_rne(B::div(load<D>(x, i, t), sv));
      B::store_i8(q + i, t, B::max_i32(B::min_i32(r, hi), lo));
    }
    return s;
  }

  template <DType D>
  static float quantize_t(const void* x, int64_t n, int8_t* q) {
    VI m0 = B::seti(0), m1 = m0;
    int64_t i = 0;
    const Tail full = B::tail(kLanes);
    for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
      m0 = B::max_u32(m0, abs_bits(load<D>(x, i, full)));
      m1 = B::max_u32(m1, abs_bits(load<D>(x, i + kLanes, full)));
    }
    for (; i < n; i += kLanes) m0 = B::max_u32(m0, abs_bits(load<D>(x, i, B::tail(n - i))));
    return quantize_with_amax<D>(x, n, amax_from<D>(B::max_u32(m0, m1), x, n), q);
  }

  static float quantize(const void* x, DType dt, int64_t n, int8_t* q) {
    return with_dtype(dt, [&](auto kDt) { return quantize_t<kDt()>(x, n, q); });
  }

  static float quantize_f32_with_amax(const float* a, int64_t n, float amax, int8_t* q) {
    return quantize_with_amax<DType::f32>(a, n, amax, q);
  }

  // --- the activation rows ------------------------------------------------------------------

  template <Activation A, DType D>
  static float activate_round_t(const float* row, int64_t inter, float* a) {
    VI m = B::seti(0);
    gated_row<A>(row, inter, [&](int64_t i, Tail t, V v) CPUMOE_X86_INLINE_LAMBDA {
      v = round_to<D>(v);
      B::store_f32(a + i, t, v);
      m = B::max_u32(m, abs_bits(v));  // lanes past the row are +0
    });
    return amax_from<DType::f32>(m, a, inter);
  }

  static float activate_round(Activation act, const float* row, int64_t inter, DType dt, float* a) {
    return with_activation(act, [&](auto kAct) {
      return with_dtype(dt, [&](auto kDt) { return activate_round_t<kAct(), kDt()>(row, inter, a); });
    });
  }

  static void activate_bf16(Activation act, const float* row, int64_t inter, uint16_t* out) {
    with_activation(act, [&](auto kAct) {
      gated_row<kAct()>(row, inter, [&](int64_t i, Tail t, V v) CPUMOE_X86_INLINE_LAMBDA {
        store(v, DType::bf16, out, i, t);
      });
    });
  }

  static void to_bf16(const void* x, DType dt, int64_t n, uint16_t* out) {
    with_dtype(dt, [&](auto kDt) {
      for (int64_t i = 0; i < n; i += kLanes) {
        const Tail t = B::tail(n - i);
        store(load<kDt()>(x, i, t), DType::bf16, out, i, t);
      }
    });
  }

  // --- the weighted combine -----------------------------------------------------------------

  template <int NJ>
  static void weighted_sum_pass_t(const float* const* ys, const float* ws, int64_t n, bool first,
                                  bool last, DType dt, void* dst, float* acc) {
    V w[NJ];
    for (int s = 0; s < NJ; ++s) w[s] = B::splat(ws[s]);
    for (int64_t i = 0; i < n; i += kLanes) {
      const Tail t = B::tail(n - i);
      V a = first ? B::splat(0.0f) : B::load_f32(acc + i, t);
      for (int s = 0; s < NJ; ++s) a = B::add(a, B::mul(w[s], B::load_f32(ys[s] + i, t)));
      if (last) store(a, dt, dst, i, t);
      else B::store_f32(acc + i, t, a);
    }
  }

  static void weighted_sum_pass(int nj, const float* const* ys, const float* ws, int64_t n,
                                bool first, bool last, DType dt, void* dst, float* acc) {
    rowops::with_slot_count(nj, [&](auto kNj) {
      weighted_sum_pass_t<kNj()>(ys, ws, n, first, last, dt, dst, acc);
    });
  }
};

/// The RowOps table of backend B.
template <class B>
constexpr RowOps make_rowops(const char* name, Isa isa) {
  using A = Algo<B>;
  return RowOps{name,           isa,         A::quantize,       A::activate_round,
                A::quantize_f32_with_amax,   A::activate_bf16,  A::to_bf16,
                A::weighted_sum_pass};
}

}  // namespace rowops_x86
}  // namespace
}  // namespace cpumoe
