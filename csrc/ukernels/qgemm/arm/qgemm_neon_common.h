// Row stores shared by the NEON qgemm kernels, which hand every finished output row to their
// store functor as two int32x4 (columns 0-3 and 4-7 of an 8-column block). Same epilogue order
// as qgemm_common.h, so all paths agree bit for bit.
// Internal linkage on purpose: each kernel file is built with its own -march, and a shared
// (weak, inline) copy could be picked by the linker from a file built for a richer ISA.
#pragma once

#if !defined(__aarch64__)
#error "qgemm_neon_common.h is for AArch64 kernel files only"
#endif

#include <arm_neon.h>

#include <cstdint>

#include "ukernels/qgemm/qgemm_common.h"

namespace cpumoe {
namespace {

inline void neon_store_f32(float* d, int32x4_t lo, int32x4_t hi, int64_t nc, float lhs_scale,
                           const float* rs, const float* bias) {
  if (nc == 8) {
    const float32x4_t ls = vdupq_n_f32(lhs_scale);
    float32x4_t f0 = vmulq_f32(vmulq_f32(vcvtq_f32_s32(lo), ls), vld1q_f32(rs));
    float32x4_t f1 = vmulq_f32(vmulq_f32(vcvtq_f32_s32(hi), ls), vld1q_f32(rs + 4));
    if (bias != nullptr) {
      f0 = vaddq_f32(f0, vld1q_f32(bias));
      f1 = vaddq_f32(f1, vld1q_f32(bias + 4));
    }
    vst1q_f32(d, f0);
    vst1q_f32(d + 4, f1);
    return;
  }
  int32_t tmp[8];
  vst1q_s32(tmp, lo);
  vst1q_s32(tmp + 4, hi);
  store_f32_row(d, tmp, nc, lhs_scale, rs, bias);
}

}  // namespace
}  // namespace cpumoe
