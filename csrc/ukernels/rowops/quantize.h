/// @file quantize.h
/// The scalar definitions of the row operations of the MoE pipeline around the GEMMs: per-row
/// int8 quantization (of x and of the activation rows), rounding a row to the input dtype,
/// storing an fp32 row in a dtype, the weighted combine. Every RowOps variant (cpumoe/rowops.h)
/// gives these bits; the vector ones are written once in rowops_vec.h, which runs the remainders
/// of its rows through the forms here. rowops_portable is these forms on x86-64.
/// Header-only; internal to the row operations and their tests (the dispatcher, csrc/moe, reaches
/// them through the RowOps interface only).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "cpumoe/activation.h"
#include "cpumoe/dtype.h"
#include "cpumoe/rowops.h"  // kAmaxFloor

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
template <class Load1>
inline float quantize_with_amax(int64_t n, int8_t* q, float amax, const Load1& load) {
  // NaN stays NaN (std::max returns its first argument when the comparison is false); an inf
  // gives an inf scale. Either way every q is 0 and the row's results are NaN.
  const float s = std::max(amax, kAmaxFloor) / 127.0f;
  for (int64_t i = 0; i < n; ++i) q[i] = quantize_one(load(i), s);
  return s;
}

/// Quantizes n elements, element i being load(i) (fp32); writes q[0..n), returns the scale
/// s = max(max|x|, kAmaxFloor) / 127.
template <class Load1>
inline float quantize(int64_t n, int8_t* q, const Load1& load) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = amax_step(amax, std::fabs(load(i)));
  return quantize_with_amax(n, q, amax, load);
}

/// Dynamic symmetric int8 quantization of one row of @p n elements of type @p dt, by definition.
inline float quantize_row_scalar(const void* x, DType dt, int64_t n, int8_t* q) {
  return with_dtype(dt, [&](auto kDt) {
    return quantize(n, q, [x](int64_t i) { return load_as_f32(x, decltype(kDt)::value, i); });
  });
}

}  // namespace rowops

extern const RowOps rowops_portable;

namespace rowops {

/// quantize_row_scalar's bits by the baseline variant (NEON on AArch64): cpumoe::quantize_row.
inline float quantize_row(const void* x, DType dt, int64_t n, int8_t* q) {
  return rowops_portable.quantize(x, dt, n, q);
}

/// Stores n fp32 values in dtype dt (rounding to nearest even).
inline void store_row(const float* acc, int64_t n, DType dt, void* dst) {
  if (dt == DType::f32) {
    std::memcpy(dst, acc, size_t(n) * 4);
    return;
  }
  auto* d = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = dt == DType::bf16 ? f32_to_bf16(acc[i]) : f32_to_f16(acc[i]);
}

/// The activation row of the op: a[0..inter) = round_to_dtype(act(gate, up)) of a GEMM1 row of
/// 2 * inter values (vec::gated_row then round_to_dtype, in one pass); returns max |a| with a NaN
/// sticking, for quantize_row_with_amax.
inline float activate_round_row(const ActivationSpec& act, const float* row, int64_t inter,
                                DType dt, float* a) {
  const GateUpLayout l = gate_up_layout(act.kind, inter);
  const float* gate = row + l.gate_offset;
  const float* up = row + l.up_offset;
  // One element at a time, in this shape: the compiler's operand order, and so which NaN a
  // two-NaN operation passes on, follows it (the bits this variant always gave).
  return with_dtype(dt, [&](auto kDt) {
    float amax = 0.0f;
    for (int64_t i = 0; i < inter; ++i) {
      const float v = vec::apply(act, gate[i * l.stride], up[i * l.stride]);
      a[i] = kDt() == DType::f32 ? v : round_to_dtype(v, kDt());
      amax = amax_step(amax, std::fabs(a[i]));
    }
    return amax;
  });
}

/// The bf16 op's activation row: out[0..inter) = f32_to_bf16(act(gate, up)) of a GEMM1 row of
/// 2 * inter values (vec::gated_row then store_row, in one pass).
inline void activate_bf16_row(const ActivationSpec& act, const float* row, int64_t inter,
                              uint16_t* out) {
  const GateUpLayout l = gate_up_layout(act.kind, inter);
  with_activation(act.kind, [&](auto kAct) {  // one straight loop per activation
    for (int64_t i = 0; i < inter; ++i)
      out[i] = f32_to_bf16(vec::apply<kAct()>(row[l.gate_offset + i * l.stride],
                                              row[l.up_offset + i * l.stride], act));
  });
}

/// quantize_row(a, DType::f32, n, q) for a row whose max |a| (NaN sticking) is already known.
inline float quantize_row_with_amax(const float* a, int64_t n, float amax, int8_t* q) {
  return quantize_with_amax(n, q, amax, [a](int64_t i) { return a[i]; });
}

namespace detail {
// One pass of the weighted combine (moe/combine.h: weighted_sum_row) over NJ slots (0 < NJ <= 8),
// unrolled so that the weights stay in registers; first: the sums start at 0.0f (else from acc);
// last: they go to dst, else to acc.
template <int NJ>
inline void weighted_sum_pass(const float* const* ys, const float* ws, int64_t n, bool first,
                              bool last, DType dt, void* dst, float* acc) {
  for (int64_t i = 0; i < n; ++i) {
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

namespace {
// RowOps::group_sums and add_group_offsets, written once: each variant's file compiles them with
// its own flags (internal linkage on purpose), where the loops vectorize; every variant gives
// these bits (integer sums; the fp32 order is the interface's).
inline void group_sums(const int8_t* q, int64_t depth, int64_t group, float* out) {
  for (int64_t g0 = 0; g0 < depth; g0 += group) {
    int32_t sum = 0;
    for (int64_t x = g0; x < g0 + group; ++x) sum += q[x];
    out[g0 / group] = float(sum);
  }
}

// add_group_offsets' work for MR rows and kC columns of one panel (the panel is padded with
// zeros, so a chunk is always whole): 4 x MR accumulators in GCC vectors of the file's widest
// registers (AVX-512: 16 floats, AVX: 8, else 4: SSE2, NEON), which stay in registers;
// elementwise IEEE multiplies and adds (no contraction: -ffp-contract=off).
#if defined(__AVX512F__)
constexpr int kGroupOffsetLanes = 16;
#elif defined(__AVX__)
constexpr int kGroupOffsetLanes = 8;
#else
constexpr int kGroupOffsetLanes = 4;
#endif
using GroupOffsetVec = float __attribute__((vector_size(4 * kGroupOffsetLanes)));
constexpr int64_t kGroupOffsetChunk = 4 * kGroupOffsetLanes;  // columns of one chunk

template <int MR>
inline void group_offset_chunk(int64_t groups, const float* sums, const float* panel,
                               const float* row_scale, int64_t lo, int64_t hi, float* dst,
                               int64_t dst_stride) {
  using V = GroupOffsetVec;
  constexpr int L = kGroupOffsetLanes;
  V acc[MR][4];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[r][c] = V{};
  for (int64_t g = 0; g < groups; ++g) {
    const float* og = panel + g * kGroupOffsetPanel;
    V o0, o1, o2, o3;
    std::memcpy(&o0, og, sizeof(V));
    std::memcpy(&o1, og + L, sizeof(V));
    std::memcpy(&o2, og + 2 * L, sizeof(V));
    std::memcpy(&o3, og + 3 * L, sizeof(V));
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const float a = sums[r * groups + g];
      acc[r][0] = acc[r][0] + a * o0;
      acc[r][1] = acc[r][1] + a * o1;
      acc[r][2] = acc[r][2] + a * o2;
      acc[r][3] = acc[r][3] + a * o3;
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* d = dst + r * dst_stride;
    const float ls = row_scale[r];
    if (lo == 0 && hi == kGroupOffsetChunk) {
      for (int c = 0; c < 4; ++c) {
        V v;
        std::memcpy(&v, d + L * c, sizeof(v));
        v = v + acc[r][c] * ls;
        std::memcpy(d + L * c, &v, sizeof(v));
      }
    } else {
      float part[kGroupOffsetChunk];
      for (int c = 0; c < 4; ++c) {  // through a copy: acc's address never taken (registers)
        const V v = acc[r][c];
        std::memcpy(part + L * c, &v, sizeof(v));
      }
      for (int64_t jj = lo; jj < hi; ++jj) d[jj - lo] = d[jj - lo] + part[jj] * ls;
    }
  }
}

inline void add_group_offsets(int64_t m, int64_t n0, int64_t n, int64_t groups,
                              const float* sums, const float* offsets, const float* row_scale,
                              float* dst, int64_t dst_stride) {
  static_assert(kGroupOffsetPanel % kGroupOffsetChunk == 0, "whole chunks in a panel");
  constexpr int64_t P = kGroupOffsetPanel, C = kGroupOffsetChunk;
  // Columns outer, rows inner: a chunk's offsets are read from memory once and stay in L1 for
  // every row.
  for (int64_t j = n0; j < n0 + n;) {
    const int64_t lo = j % C, hi = std::min(C, lo + (n0 + n - j));
    const float* chunk = offsets + (j / P) * groups * P + (j % P - lo);
    for (int64_t i0 = 0; i0 < m; i0 += 4) {
      const float* s = sums + i0 * groups;
      float* d = dst + i0 * dst_stride + (j - n0);
      const float* ls = row_scale + i0;
      switch (std::min<int64_t>(4, m - i0)) {  // rows that share one pass over the offsets
        case 4: group_offset_chunk<4>(groups, s, chunk, ls, lo, hi, d, dst_stride); break;
        case 3: group_offset_chunk<3>(groups, s, chunk, ls, lo, hi, d, dst_stride); break;
        case 2: group_offset_chunk<2>(groups, s, chunk, ls, lo, hi, d, dst_stride); break;
        default: group_offset_chunk<1>(groups, s, chunk, ls, lo, hi, d, dst_stride); break;
      }
    }
    j += hi - lo;
  }
}
}  // namespace

/// detail::weighted_sum_pass for a run-time slot count nj in 1..8 (RowOps::weighted_sum_pass).
inline void weighted_sum_pass(int nj, const float* const* ys, const float* ws, int64_t n,
                              bool first, bool last, DType dt, void* dst, float* acc) {
  with_slot_count(nj, [&](auto kNj) {
    detail::weighted_sum_pass<kNj()>(ys, ws, n, first, last, dt, dst, acc);
  });
}

}  // namespace rowops
}  // namespace cpumoe
