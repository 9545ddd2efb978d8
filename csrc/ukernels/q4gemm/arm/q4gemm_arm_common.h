// What the AArch64 q4gemm (W4A8) kernels share: the in-register unpacking of 4-bit codes into
// int8 (per format), the E8M0 scale decode, and the final row store.
// Internal linkage on purpose (see qgemm/qgemm_common.h): each kernel file has its own -march.
#pragma once

#if !defined(__aarch64__)
#error "q4gemm_arm_common.h is for AArch64 kernel files only"
#endif

#include <arm_neon.h>

#include <cstdint>

#include "ukernels/q4gemm/q4gemm_common.h"

namespace cpumoe {
namespace {

/// The two int8 registers held in one register of codes (16 bytes, two codes each): lo() the low
/// nibbles, hi() the high nibbles, and cvt(), the conversion of an int32 sum of products of int8
/// activations with them back to float(exact sum).
///   int4:  lo = r << 4 and hi = r & 0xf0 are the two's-complement values times 16 (one
///          instruction each, no sign-extension shift: the scale 16 is exact in int32 and
///          removed by the fixed-point convert, scvtf #4, exact as the sum is a multiple of 16).
///          |16 * sum| <= 16 * 128 * 8 * g < 2^31 for any g < 131072.
///   mxfp4: a tbl lookup through the format's table (the values 2 * E2M1 up to 12 do not fit
///          times 16), on r & 0xf and r >> 4.
template <W4Format F>
struct W4Codes;

template <>
struct W4Codes<W4Format::int4> {
  explicit W4Codes(const int8_t* /*table*/) {}
  int8x16_t lo(uint8x16_t r) const { return vreinterpretq_s8_u8(vshlq_n_u8(r, 4)); }
  int8x16_t hi(uint8x16_t r) const { return vreinterpretq_s8_u8(vandq_u8(r, vdupq_n_u8(0xf0))); }
  static float32x4_t cvt(int32x4_t s) { return vcvtq_n_f32_s32(s, 4); }
};

template <>
struct W4Codes<W4Format::mxfp4> {
  int8x16_t t;
  explicit W4Codes(const int8_t* table) : t(vld1q_s8(table)) {}
  int8x16_t lo(uint8x16_t r) const { return vqtbl1q_s8(t, vandq_u8(r, vdupq_n_u8(0x0f))); }
  int8x16_t hi(uint8x16_t r) const { return vqtbl1q_s8(t, vshrq_n_u8(r, 4)); }
  static float32x4_t cvt(int32x4_t s) { return vcvtq_f32_s32(s); }
};

/// w4_mxfp4_scale of 8 E8M0 bytes (columns 0-3 in s0, 4-7 in s1), exactly: x = e << 23 is
/// 2^(e - 127) for 1 <= e <= 254 and +inf for 255; x = max(x, 2^-127) covers e = 0; then
/// x - x * 0.5 = 2^(e - 128) exactly (subnormals included: Linux runs with FZ off), and inf - inf
/// is the NaN of e = 255.
inline void mxfp4_scales(const uint8_t* e, float32x4_t& s0, float32x4_t& s1) {
  const uint16x8_t e7 = vshll_n_u8(vld1_u8(e), 7);
  const uint32x4_t lo = vshll_n_u16(vget_low_u16(e7), 16), hi = vshll_high_n_u16(e7, 16);
  const uint32x4_t floor = vdupq_n_u32(0x00400000u);  // 2^-127
  const float32x4_t x0 = vreinterpretq_f32_u32(vmaxq_u32(lo, floor));
  const float32x4_t x1 = vreinterpretq_f32_u32(vmaxq_u32(hi, floor));
  const float32x4_t half = vdupq_n_f32(0.5f);
  s0 = vsubq_f32(x0, vmulq_f32(x0, half));
  s1 = vsubq_f32(x1, vmulq_f32(x1, half));
}

/// The 8 fp32 scales of a packed group (8 columns) whose scale bytes are at @p s.
template <W4Format F>
inline void group_scales8(const uint8_t* s, float32x4_t& s0, float32x4_t& s1) {
  if constexpr (F == W4Format::mxfp4) {
    mxfp4_scales(s, s0, s1);
  } else {
    s0 = vld1q_f32(reinterpret_cast<const float*>(s));
    s1 = vld1q_f32(reinterpret_cast<const float*>(s) + 4);
  }
}

/// Stores the 8 accumulated columns (f0: 0-3, f1: 4-7) of one row as acc * lhs_scale + bias
/// (bias: nullptr or the block's first column), the first @p nc of them.
inline void store_q4_row8(float* d, float32x4_t f0, float32x4_t f1, int64_t nc, float ls,
                          const float* bias) {
  if (nc == 8) {
    const float32x4_t l = vdupq_n_f32(ls);
    f0 = vmulq_f32(f0, l);
    f1 = vmulq_f32(f1, l);
    if (bias != nullptr) {
      f0 = vaddq_f32(f0, vld1q_f32(bias));
      f1 = vaddq_f32(f1, vld1q_f32(bias + 4));
    }
    vst1q_f32(d, f0);
    vst1q_f32(d + 4, f1);
    return;
  }
  float tmp[8];
  vst1q_f32(tmp, f0);
  vst1q_f32(tmp + 4, f1);
  store_q4_row(d, tmp, nc, ls, bias);
}

}  // namespace
}  // namespace cpumoe
