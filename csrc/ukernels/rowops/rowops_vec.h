// The row operations (cpumoe/rowops.h) written once over a vector backend B: rowops_avx512
// (x86/, 16 lanes, masked tails), rowops_avx2 (x86/, 8 lanes, tails through a stack buffer),
// rowops_portable on AArch64 and rowops_neon_bf16 (arm/rowops_neon.h, 4 lanes, scalar
// remainders, 8-float loads) differ only in B. The activation math is vec::Math of
// cpumoe/activation.h over the same B. The bits are those of the scalar definitions:
//  - every arithmetic step is the scalar form's IEEE operation in the same order (no FMA, no
//    reciprocal approximations: a division stays a division);
//  - a ternary clamp `x > c ? c : x` is min(c, x) and `x < c ? c : x` is max(c, x), which keep x
//    when it is NaN (VMINPS / VMAXPS return their second operand; FMIN / FMAX return the NaN);
//  - the absolute maximum: x86 takes an unsigned max of |x|'s bits (the order of non-negative
//    floats) and a row with a NaN falls back to the scalar rule for the exact NaN the scalar code
//    returns; NEON takes FMAX / FMAXV, which keep a NaN;
//  - rounding to int8 rounds to nearest even in the instruction (independent of MXCSR / FPCR
//    RMode: VCVTPS2DQ after VROUNDPS, FCVTNS), which is the scalar magic-number rounding for
//    |v| <= 128; a non-finite scale (inf or NaN amax) quantizes every element to 0, as x / s does
//    in the scalar form;
//  - bf16 rounding is the integer rule of dtype.h (or BFCVTN, the same bits); f16 is the
//    hardware conversion (IEEE round to nearest even, subnormals, overflow to inf) with NaN lanes
//    set to sign | 0x7e00 as f32_to_f16 does.
// With masked tails (B::kMaskedTails), lanes past a row's end load as +0 and are never stored;
// every activation maps (0, 0) to +0, so they never raise a row's absolute maximum. Without, the
// remainder of a row runs through the scalar definitions of quantize.h / activation.h.
//
// The backend B provides (all static), besides vec::Math's operations (splat ... pow2i):
// V, VI (fp32 / int32 vectors), H (kLanes 16-bit values), Tail (which lanes of a chunk are
// real: tail(r) for r >= 1 remaining elements), kLanes, kMaskedTails, kAmaxUnroll; bits,
// from_bits, seti, and_, or_, addi, srli<N>; VA, amax_zero, amax_acc(VA, V), amax_merge,
// reduce_amax(VA, bool* nan); nan_select(v, if_number, if_nan) (int lanes picked by whether v is
// NaN); cvt_rne (to int32, nearest even); loads load_f32, load_h; stores store_f32, store_h;
// widen_bf16(H) (bf16 bits to fp32), narrow_high(VI) (high halves to H), f16_from(V) (nearest
// even), f32_from_f16(H), f16_nan_fix(H, V) (NaN lanes of V to sign | 0x7e00); and with
// kBf16Cvt, bf16_round(V) / bf16_narrow(V) (hardware rounding instead of the integer rule).
// Masked-tail backends: store_i8, min_i32, max_i32, deinterleave(lo, hi, &even, &odd).
// Remainder backends: load_f32x2, load_deinterleaved, kQuantUnroll and store_q (that many
// int32 vectors, saturated to int8, low bound -127), H2, combine_h, store_h2 (and, with
// kBf16Cvt, bf16_narrow2), acc_add(a, p) (a + p, with p's NaN when both are NaN).
//
// Internal linkage on purpose: each variant's file instantiates these with its own ISA flags.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpumoe/activation.h"
#include "cpumoe/rowops.h"
#include "ukernels/rowops/quantize.h"  // the scalar definitions (remainders, NaN fallbacks)

namespace cpumoe {
namespace {
namespace rowops_vec {

#define CPUMOE_ROWOPS_INLINE CPUMOE_ACT_INLINE
#define CPUMOE_ROWOPS_INLINE_LAMBDA CPUMOE_ACT_INLINE_LAMBDA

template <class B>
struct Algo {
  using V = typename B::V;
  using VI = typename B::VI;
  using H = typename B::H;
  using Tail = typename B::Tail;
  using M = vec::Math<B>;
  static constexpr int64_t kLanes = B::kLanes;

  // sink(i, tail, act(gate, up) of lanes i..) over a GEMM1 row of 2 * inter values, in the layout
  // of gate_up_layout(A): halves, or (swigluoai) gate and up interleaved. Returns how many
  // columns it did: all with masked tails, else a multiple of kLanes (the caller does the rest).
  template <Activation A, class Sink>
  static CPUMOE_ROWOPS_INLINE int64_t gated_row(const float* row, int64_t inter,
                                                 const ActivationSpec& p, const Sink& sink) {
    int64_t i = 0;
    if constexpr (B::kMaskedTails) {
      for (; i < inter; i += kLanes) {
        const Tail t = B::tail(inter - i);
        if constexpr (interleaved_gate_up(A)) {
          const int64_t r = 2 * (inter - i);  // floats left in the row
          const V lo = B::load_f32(row + 2 * i, B::tail(r));
          const V hi = r > kLanes ? B::load_f32(row + 2 * i + kLanes, B::tail(r - kLanes)) : B::splat(0.0f);
          V g, u;
          B::deinterleave(lo, hi, &g, &u);
          sink(i, t, M::template activate<A>(g, u, p));
        } else {
          sink(i, t, M::template activate<A>(B::load_f32(row + i, t), B::load_f32(row + inter + i, t), p));
        }
      }
    } else {
      const Tail full = B::tail(kLanes);
      if constexpr (interleaved_gate_up(A)) {
        for (; i + kLanes <= inter; i += kLanes) {
          V g, u;
          B::load_deinterleaved(row + 2 * i, &g, &u);
          sink(i, full, M::template activate<A>(g, u, p));
        }
      } else {
        const float* up = row + inter;
        for (; i + 2 * kLanes <= inter; i += 2 * kLanes) {  // one load of 2 kLanes per half
          V g0, g1, u0, u1;
          B::load_f32x2(row + i, &g0, &g1);
          B::load_f32x2(up + i, &u0, &u1);
          sink(i, full, M::template activate<A>(g0, u0, p));
          sink(i + kLanes, full, M::template activate<A>(g1, u1, p));
        }
        for (; i + kLanes <= inter; i += kLanes)
          sink(i, full, M::template activate<A>(B::load_f32(row + i, full), B::load_f32(up + i, full), p));
      }
    }
    return i;
  }

  // act(gate, up) of column i, scalar (the remainder of gated_row).
  template <Activation A>
  static CPUMOE_ROWOPS_INLINE float gated_one(const float* row, int64_t inter, int64_t i,
                                              const ActivationSpec& p) {
    if constexpr (interleaved_gate_up(A)) return vec::apply<A>(row[2 * i], row[2 * i + 1], p);
    return vec::apply<A>(row[i], row[inter + i], p);
  }

  // --- dtype conversions --------------------------------------------------------------------

  template <DType D>
  static CPUMOE_ROWOPS_INLINE V load(const void* x, int64_t i, Tail t) {
    if constexpr (D == DType::f32) {
      return B::load_f32(static_cast<const float*>(x) + i, t);
    } else {
      const H h = B::load_h(static_cast<const uint16_t*>(x) + i, t);
      if constexpr (D == DType::bf16) return B::widen_bf16(h);
      return B::f32_from_f16(h);
    }
  }

  // f32_to_bf16 of each lane by the integer rule, in the high half (low half zero).
  static CPUMOE_ROWOPS_INLINE VI bf16_bits_high(V v) {
    const VI u = B::bits(v);
    const VI lsb = B::and_(B::template srli<16>(u), B::seti(1));
    const VI r = B::addi(B::addi(u, B::seti(0x7fff)), lsb);
    const VI quiet = B::or_(u, B::seti(0x400000));  // NaN stays a quiet NaN
    return B::and_(B::nan_select(v, r, quiet), B::seti(int32_t(0xffff0000u)));
  }

  // f32_to_bf16 of each lane.
  static CPUMOE_ROWOPS_INLINE H bf16_bits(V v) {
    if constexpr (B::kBf16Cvt) return B::bf16_narrow(v);
    else return B::narrow_high(bf16_bits_high(v));
  }

  // f32_to_f16 of each lane.
  static CPUMOE_ROWOPS_INLINE H f16_bits(V v) { return B::f16_nan_fix(B::f16_from(v), v); }

  // round_to_dtype(v, D), lane-wise.
  template <DType D>
  static CPUMOE_ROWOPS_INLINE V round_to(V v) {
    if constexpr (D == DType::bf16) {
      if constexpr (B::kBf16Cvt) return B::bf16_round(v);
      else return B::from_bits(bf16_bits_high(v));
    }
    if constexpr (D == DType::f16) return B::f32_from_f16(f16_bits(v));
    return v;
  }

  // Stores the real lanes of v at element i of dst in dtype dt (rounding to nearest even).
  static CPUMOE_ROWOPS_INLINE void store(V v, DType dt, void* dst, int64_t i, Tail t) {
    if (dt == DType::f32) B::store_f32(static_cast<float*>(dst) + i, t, v);
    else if (dt == DType::bf16) B::store_h(static_cast<uint16_t*>(dst) + i, t, bf16_bits(v));
    else B::store_h(static_cast<uint16_t*>(dst) + i, t, f16_bits(v));
  }

  // store() of 2 kLanes full lanes, a then b (one 16-bit store for the narrow dtypes).
  static CPUMOE_ROWOPS_INLINE void store2(V a, V b, DType dt, void* dst, int64_t i) {
    if (dt == DType::f32) {
      B::store_f32(static_cast<float*>(dst) + i, B::tail(kLanes), a);
      B::store_f32(static_cast<float*>(dst) + i + kLanes, B::tail(kLanes), b);
    } else if (dt == DType::bf16) {
      if constexpr (B::kBf16Cvt) B::store_h2(static_cast<uint16_t*>(dst) + i, B::bf16_narrow2(a, b));
      else B::store_h2(static_cast<uint16_t*>(dst) + i, B::combine_h(bf16_bits(a), bf16_bits(b)));
    } else {
      B::store_h2(static_cast<uint16_t*>(dst) + i, B::combine_h(f16_bits(a), f16_bits(b)));
    }
  }

  // --- quantization -------------------------------------------------------------------------

  // The scalar amax of a row, from amax over elements [i0, n) (NaN: the last met, as amax_step).
  template <DType D>
  static float scalar_amax(const void* x, int64_t i0, int64_t n, float amax) {
    for (int64_t i = i0; i < n; ++i) amax = rowops::amax_step(amax, std::fabs(load_as_f32(x, D, i)));
    return amax;
  }

  // The row's amax from the vector part m (elements [0, i0)) and the scalar rest: a backend
  // whose reduction cannot give the scalar NaN redoes the row by the scalar rule.
  template <DType D>
  static CPUMOE_ROWOPS_INLINE float amax_from(typename B::VA m, const void* x, int64_t i0, int64_t n) {
    if (i0 == 0) return scalar_amax<D>(x, 0, n, 0.0f);
    bool nan = false;
    const float a = B::reduce_amax(m, &nan);
    if (nan) return scalar_amax<D>(x, 0, n, 0.0f);
    return scalar_amax<D>(x, i0, n, a);
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
    int64_t i = 0;
    if constexpr (B::kMaskedTails) {
      const VI hi = B::seti(127), lo = B::seti(-127);
      for (; i < n; i += kLanes) {
        const Tail t = B::tail(n - i);
        const VI r = B::cvt_rne(B::div(load<D>(x, i, t), sv));
        B::store_i8(q + i, t, B::max_i32(B::min_i32(r, hi), lo));
      }
    } else {
      constexpr int64_t U = B::kQuantUnroll;
      const Tail full = B::tail(kLanes);
      for (; i + U * kLanes <= n; i += U * kLanes) {
        decltype(B::cvt_rne(sv)) r[U];
        for (int64_t j = 0; j < U; ++j) r[j] = B::cvt_rne(B::div(load<D>(x, i + j * kLanes, full), sv));
        B::store_q(q + i, r);
      }
      for (; i < n; ++i) q[i] = rowops::quantize_one(load_as_f32(x, D, i), s);
    }
    return s;
  }

  template <DType D>
  static float quantize_t(const void* x, int64_t n, int8_t* q) {
    constexpr int64_t U = B::kAmaxUnroll;
    typename B::VA m[U];
    for (int64_t j = 0; j < U; ++j) m[j] = B::amax_zero();
    int64_t i = 0;
    const Tail full = B::tail(kLanes);
    for (; i + U * kLanes <= n; i += U * kLanes)
      for (int64_t j = 0; j < U; ++j) m[j] = B::amax_acc(m[j], load<D>(x, i + j * kLanes, full));
    if constexpr (B::kMaskedTails)
      for (; i < n; i += kLanes) m[0] = B::amax_acc(m[0], load<D>(x, i, B::tail(n - i)));
    for (int64_t s = 1; s < U; s *= 2)  // a tree: (0, 1), (2, 3), then (0, 2)
      for (int64_t j = 0; j + s < U; j += 2 * s) m[j] = B::amax_merge(m[j], m[j + s]);
    return quantize_with_amax<D>(x, n, amax_from<D>(m[0], x, i, n), q);
  }

  static float quantize(const void* x, DType dt, int64_t n, int8_t* q) {
    return with_dtype(dt, [&](auto kDt) { return quantize_t<kDt()>(x, n, q); });
  }

  static float quantize_f32_with_amax(const float* a, int64_t n, float amax, int8_t* q) {
    return quantize_with_amax<DType::f32>(a, n, amax, q);
  }

  // --- the activation rows ------------------------------------------------------------------

  template <Activation A, DType D>
  static float activate_round_t(const float* row, int64_t inter, const ActivationSpec& p,
                                float* a) {
    typename B::VA m = B::amax_zero();
    const int64_t i0 = gated_row<A>(row, inter, p, [&](int64_t i, Tail t, V v) CPUMOE_ROWOPS_INLINE_LAMBDA {
      v = round_to<D>(v);
      B::store_f32(a + i, t, v);
      m = B::amax_acc(m, v);  // lanes past the row are +0
    });
    for (int64_t i = i0; i < inter; ++i) {
      const float v = gated_one<A>(row, inter, i, p);
      a[i] = D == DType::f32 ? v : round_to_dtype(v, D);
    }
    return amax_from<DType::f32>(m, a, i0, inter);
  }

  static float activate_round(const ActivationSpec& act, const float* row, int64_t inter, DType dt,
                              float* a) {
    return with_activation(act.kind, [&](auto kAct) {
      return with_dtype(dt, [&](auto kDt) {
        return activate_round_t<kAct(), kDt()>(row, inter, act, a);
      });
    });
  }

  static void activate_bf16(const ActivationSpec& act, const float* row, int64_t inter,
                            uint16_t* out) {
    with_activation(act.kind, [&](auto kAct) {
      const int64_t i0 = gated_row<kAct()>(row, inter, act, [&](int64_t i, Tail t, V v) CPUMOE_ROWOPS_INLINE_LAMBDA {
        store(v, DType::bf16, out, i, t);
      });
      for (int64_t i = i0; i < inter; ++i) out[i] = f32_to_bf16(gated_one<kAct()>(row, inter, i, act));
    });
  }

  static void to_bf16(const void* x, DType dt, int64_t n, uint16_t* out) {
    with_dtype(dt, [&](auto kDt) {
      int64_t i = 0;
      if constexpr (B::kMaskedTails) {
        for (; i < n; i += kLanes) {
          const Tail t = B::tail(n - i);
          store(load<kDt()>(x, i, t), DType::bf16, out, i, t);
        }
      } else {
        for (; i + kLanes <= n; i += kLanes)
          store(load<kDt()>(x, i, B::tail(kLanes)), DType::bf16, out, i, B::tail(kLanes));
      }
      for (; i < n; ++i) out[i] = f32_to_bf16(load_as_f32(x, kDt(), i));
    });
  }

  // --- the weighted combine -----------------------------------------------------------------

  template <int NJ>
  static void weighted_sum_pass_t(const float* const* ys, const float* ws, int64_t n, bool first,
                                  bool last, DType dt, void* dst, float* acc) {
    V w[NJ];
    for (int s = 0; s < NJ; ++s) w[s] = B::splat(ws[s]);
    int64_t i = 0;
    if constexpr (B::kMaskedTails) {
      for (; i < n; i += kLanes) {
        const Tail t = B::tail(n - i);
        V a = first ? B::splat(0.0f) : B::load_f32(acc + i, t);
        for (int s = 0; s < NJ; ++s) a = B::add(a, B::mul(w[s], B::load_f32(ys[s] + i, t)));
        if (last) store(a, dt, dst, i, t);
        else B::store_f32(acc + i, t, a);
      }
    } else {
      const float* y[NJ];
      for (int s = 0; s < NJ; ++s) y[s] = ys[s];
      const Tail full = B::tail(kLanes);
      for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
        V a0 = first ? B::splat(0.0f) : B::load_f32(acc + i, full);
        V a1 = first ? B::splat(0.0f) : B::load_f32(acc + i + kLanes, full);
        for (int s = 0; s < NJ; ++s) {
          V v0, v1;
          B::load_f32x2(y[s] + i, &v0, &v1);  // one load of 2 kLanes
          a0 = B::acc_add(a0, B::mul(w[s], v0));
          a1 = B::acc_add(a1, B::mul(w[s], v1));
        }
        if (!last) {
          B::store_f32(acc + i, full, a0);
          B::store_f32(acc + i + kLanes, full, a1);
        } else {
          store2(a0, a1, dt, dst, i);
        }
      }
      for (; i < n; ++i) {
        float a = first ? 0.0f : acc[i];
        for (int s = 0; s < NJ; ++s) a += ws[s] * ys[s][i];
        if (!last) acc[i] = a;
        else if (dt == DType::f32) static_cast<float*>(dst)[i] = a;
        else static_cast<uint16_t*>(dst)[i] = dt == DType::bf16 ? f32_to_bf16(a) : f32_to_f16(a);
      }
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
                A::weighted_sum_pass,        rowops::group_sums,
                rowops::add_group_offsets};
}

}  // namespace rowops_vec
}  // namespace
}  // namespace cpumoe
