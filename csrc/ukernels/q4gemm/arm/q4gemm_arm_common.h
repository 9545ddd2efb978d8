// What the AArch64 q4gemm (W4A8) kernels share: the facts behind their unpacking and E8M0 decode,
// the 8-bit codes' stored form, the format dispatch and the final row store.
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

// The kernels' inner loops are asm; they share these facts (each file says how it uses them):
//   - int4 codes unpack with one instruction per 32 values where a byte's two nibbles meet the
//     same activations (the I8MM and SDOT kernels): with the low nibble stored offset (v + 8,
//     OffsetLowInt4) the raw byte read as int8 is exactly 16 hi + lo + 8, itself an operand, and
//     r & 0x0f is lo + 8. Y = dot(a, r & 0x0f) and X = dot(a, r) give X - Y = 16 dot(a, hi) (the
//     fixed-point convert scvtf #4 makes float(sum) of it exactly) and Y - 8 sum a = dot(a, lo):
//     the group's int32 accumulators start at -8 sum a. |X| <= 136 * 128 * g < 2^31 up to
//     kW4MaxGroup.
//   - mxfp4 codes (values 2 * E2M1 up to 12 do not fit times 16) go through a tbl lookup of the
//     format's table on r & 0xf and r >> 4.
//   - int8_affine's 8-bit codes (Q4GemmUkernel::codes8) are stored as the int8 values c - 128
//     (c ^ 0x80, Bytes::code), one per byte in the operand order of the kernel's int8 instruction,
//     so the loaded bytes are the operands themselves (the I8MM and SDOT kernels: no unpacking,
//     twice the loads of int4; the BF16 kernel widens them to bf16, see there) and the group's
//     accumulators start at zero; |sum| <= 128 * 128 * g <= 2^30 up to kW4MaxGroup.
//   - An E8M0 scale byte e becomes w4_mxfp4_scale(e) with plain NEON: x = e << 23 (ushll #7 then
//     shll #16) is 2^(e - 127) for 1 <= e <= 254 and +inf for 255; umax with 2^-127 covers e = 0;
//     x - x * 0.5 is 2^(e - 128) exactly (subnormals included: Linux runs with FZ off), and
//     inf - inf is the NaN of e = 255.

/// 64 zero bytes: the asm loops zero (or, for mxfp4 and 8-bit codes, start) four accumulators
/// with one ld1 of it.
alignas(64) constexpr int32_t kZeros[16] = {};

/// Q4Packing's Bytes of the kernels: 8-bit code c stored as the int8 value c - 128, at
/// Index::index(c, kk, g) (the kernel's operand order).
template <class Index>
struct SignedBytes : Index {
  static uint8_t code(uint8_t c) { return uint8_t(c ^ 0x80); }
};

/// pack_rhs_q4's Recode of the one-`and` kernels (above): int4 low nibbles hold v + 8 (bit 3 of
/// the two's-complement code flipped), high nibbles and mxfp4 codes as they are.
struct OffsetLowInt4 {
  static uint8_t code(uint8_t c, int64_t idx, W4Format f) {
    return f == W4Format::int4 && idx % 2 == 0 ? uint8_t(c ^ 8) : c;
  }
};

/// Q4GemmUkernel::run_f32 of a kernel whose loops are one function per format (the unpacking and
/// the scale decode differ; kBytes: int8_affine's 8-bit codes) and per presence of
/// ep.lhs_group_scale (the *Gs variants; a separate function, so the plain loops stay as they
/// were): empty calls return at once, the rest go to their loops.
template <decltype(Q4GemmUkernel::run_f32) kInt4, decltype(Q4GemmUkernel::run_f32) kMxfp4,
          decltype(Q4GemmUkernel::run_f32) kBytes, decltype(Q4GemmUkernel::run_f32) kInt4Gs,
          decltype(Q4GemmUkernel::run_f32) kMxfp4Gs, decltype(Q4GemmUkernel::run_f32) kBytesGs>
void q4_run_f32(int64_t m, int64_t n, int64_t k, const W4Layout& w, const void* lhs,
                const void* rhs, float* dst, int64_t dst_stride, const Q4GemmEpilogue& ep) {
  if (m <= 0 || n <= 0) return;
  const bool gs = ep.lhs_group_scale != nullptr;
  decltype(Q4GemmUkernel::run_f32) f;
  if (w.format == W4Format::mxfp4) f = gs ? kMxfp4Gs : kMxfp4;
  else if (w.format == W4Format::int8_affine) f = gs ? kBytesGs : kBytes;
  else f = gs ? kInt4Gs : kInt4;
  f(m, n, k, w, lhs, rhs, dst, dst_stride, ep);
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
