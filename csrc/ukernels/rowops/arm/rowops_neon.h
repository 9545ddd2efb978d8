// The baseline-NEON backend of rowops_vec.h (Armv8.0 Advanced SIMD, which every AArch64 CPU
// has: no ISA flag or run-time check): 4 fp32 lanes, rows in 8-float loads (LD1 of two
// registers, LD2 for the interleaved swigluoai row), quantization 16 elements per store, the
// remainder of a row through the scalar definitions. Neon is rowops_portable on AArch64;
// rowops_neon_bf16 derives from it with the BFCVTN rounding.
// Why each step gives the scalar bits: FRINTN is the magic-number rounding exactly
// (|x log2 e| <= 128 in exp; NaN stays NaN); (int(n) + 127) << 23 is int(n * 2^23) + (127 << 23),
// FCVTZS with 23 fraction bits (NaN -> 0 by itself); FMIN / FMAX keep a NaN as the ternary
// clamps do; FCVTNS rounds half to even with NaN -> 0, and the saturating narrows plus a max
// with -127 are the clamp to [-127, 127]; FCVTN / FCVTL are f32_to_f16 up to the NaN lanes.
#pragma once

#if !defined(__aarch64__)
#error "rowops_neon.h is the AArch64 backend"
#endif

#include <arm_neon.h>

#include "ukernels/rowops/rowops_vec.h"

namespace cpumoe {
namespace {
namespace rowops_vec {

struct Neon {
  using V = float32x4_t;
  using VI = uint32x4_t;
  using VA = float32x4_t;  // the absolute maximum by FMAX, which keeps a NaN
  using H = uint16x4_t;
  using H2 = uint16x8_t;
  struct Tail {};  // every vector chunk is full (the remainder is scalar)
  static constexpr int64_t kLanes = 4;
  static constexpr bool kMaskedTails = false;
  static constexpr bool kBf16Cvt = false;
  static constexpr int64_t kAmaxUnroll = 4;
  static constexpr int64_t kQuantUnroll = 4;

  static CPUMOE_ROWOPS_INLINE Tail tail(int64_t) { return {}; }
  static CPUMOE_ROWOPS_INLINE V splat(float f) { return vdupq_n_f32(f); }
  static CPUMOE_ROWOPS_INLINE V add(V a, V b) { return vaddq_f32(a, b); }
  static CPUMOE_ROWOPS_INLINE V sub(V a, V b) { return vsubq_f32(a, b); }
  static CPUMOE_ROWOPS_INLINE V mul(V a, V b) { return vmulq_f32(a, b); }
  static CPUMOE_ROWOPS_INLINE V div(V a, V b) { return vdivq_f32(a, b); }
  // a + p for the combine's sums: FADD returns its first operand's NaN when both are NaN, and
  // the compiler orders the operands of vaddq_f32 as it likes, so asm pins p first (the bits
  // rowops_portable always gave).
  static CPUMOE_ROWOPS_INLINE V acc_add(V a, V p) {
    V r;
    asm("fadd %0.4s, %1.4s, %2.4s" : "=w"(r) : "w"(p), "w"(a));
    return r;
  }
  static CPUMOE_ROWOPS_INLINE V min(V c, V x) { return vminq_f32(x, c); }
  static CPUMOE_ROWOPS_INLINE V max(V c, V x) { return vmaxq_f32(x, c); }
  static CPUMOE_ROWOPS_INLINE V neg(V x) { return vnegq_f32(x); }
  static CPUMOE_ROWOPS_INLINE V abs(V x) { return vabsq_f32(x); }
  static CPUMOE_ROWOPS_INLINE V copysign(V mag, V sgn) {
    return vbslq_f32(vdupq_n_u32(0x80000000u), sgn, mag);
  }
  static CPUMOE_ROWOPS_INLINE V rint(V v) { return vrndnq_f32(v); }
  static CPUMOE_ROWOPS_INLINE V pow2i(V n) {
    return vreinterpretq_f32_s32(vaddq_s32(vcvtq_n_s32_f32(n, 23), vdupq_n_s32(127 << 23)));
  }

  static CPUMOE_ROWOPS_INLINE VI bits(V v) { return vreinterpretq_u32_f32(v); }
  static CPUMOE_ROWOPS_INLINE V from_bits(VI v) { return vreinterpretq_f32_u32(v); }
  static CPUMOE_ROWOPS_INLINE VI seti(int32_t v) { return vdupq_n_u32(uint32_t(v)); }
  static CPUMOE_ROWOPS_INLINE VI and_(VI a, VI b) { return vandq_u32(a, b); }
  static CPUMOE_ROWOPS_INLINE VI or_(VI a, VI b) { return vorrq_u32(a, b); }
  static CPUMOE_ROWOPS_INLINE VI addi(VI a, VI b) { return vaddq_u32(a, b); }
  template <int N>
  static CPUMOE_ROWOPS_INLINE VI srli(VI a) { return vshrq_n_u32(a, N); }
  static CPUMOE_ROWOPS_INLINE VI nan_select(V v, VI if_number, VI if_nan) {
    return vbslq_u32(vceqq_f32(v, v), if_number, if_nan);
  }

  static CPUMOE_ROWOPS_INLINE VA amax_zero() { return vdupq_n_f32(0.0f); }
  static CPUMOE_ROWOPS_INLINE VA amax_acc(VA m, V v) { return vmaxq_f32(m, vabsq_f32(v)); }
  static CPUMOE_ROWOPS_INLINE VA amax_merge(VA a, VA b) { return vmaxq_f32(a, b); }
  static CPUMOE_ROWOPS_INLINE float reduce_amax(VA m, bool* nan) {
    *nan = false;  // FMAXV keeps a NaN: the scale is NaN as in the scalar rule
    return vmaxvq_f32(m);
  }

  static CPUMOE_ROWOPS_INLINE int32x4_t cvt_rne(V v) { return vcvtnq_s32_f32(v); }
  static CPUMOE_ROWOPS_INLINE void store_q(int8_t* q, const int32x4_t (&r)[4]) {
    const int16x8_t h0 = vqmovn_high_s32(vqmovn_s32(r[0]), r[1]);
    const int16x8_t h1 = vqmovn_high_s32(vqmovn_s32(r[2]), r[3]);
    vst1q_s8(q, vmaxq_s8(vqmovn_high_s16(vqmovn_s16(h0), h1), vdupq_n_s8(-127)));
  }

  static CPUMOE_ROWOPS_INLINE V load_f32(const float* p, Tail) { return vld1q_f32(p); }
  static CPUMOE_ROWOPS_INLINE void load_f32x2(const float* p, V* a, V* b) {
    const float32x4x2_t v = vld1q_f32_x2(p);  // one LD1 of 8 floats
    *a = v.val[0];
    *b = v.val[1];
  }
  static CPUMOE_ROWOPS_INLINE void load_deinterleaved(const float* p, V* even, V* odd) {
    const float32x4x2_t v = vld2q_f32(p);
    *even = v.val[0];
    *odd = v.val[1];
  }
  static CPUMOE_ROWOPS_INLINE H load_h(const uint16_t* p, Tail) { return vld1_u16(p); }
  static CPUMOE_ROWOPS_INLINE void store_f32(float* p, Tail, V v) { vst1q_f32(p, v); }
  static CPUMOE_ROWOPS_INLINE void store_h(uint16_t* p, Tail, H h) { vst1_u16(p, h); }
  static CPUMOE_ROWOPS_INLINE H2 combine_h(H a, H b) { return vcombine_u16(a, b); }
  static CPUMOE_ROWOPS_INLINE void store_h2(uint16_t* p, H2 h) { vst1q_u16(p, h); }

  static CPUMOE_ROWOPS_INLINE V widen_bf16(H h) { return vreinterpretq_f32_u32(vshll_n_u16(h, 16)); }
  static CPUMOE_ROWOPS_INLINE H narrow_high(VI v) { return vshrn_n_u32(v, 16); }
  static CPUMOE_ROWOPS_INLINE H f16_from(V v) { return vreinterpret_u16_f16(vcvt_f16_f32(v)); }
  static CPUMOE_ROWOPS_INLINE V f32_from_f16(H h) { return vcvt_f32_f16(vreinterpret_f16_u16(h)); }
  static CPUMOE_ROWOPS_INLINE H f16_nan_fix(H h, V v) {
    const uint16x4_t nan = vmovn_u32(vmvnq_u32(vceqq_f32(v, v)));
    const uint16x4_t quiet =
        vorr_u16(vshrn_n_u32(vandq_u32(bits(v), vdupq_n_u32(0x80000000u)), 16), vdup_n_u16(0x7e00));
    return vbsl_u16(nan, quiet, h);
  }
};

}  // namespace rowops_vec
}  // namespace
}  // namespace cpumoe
