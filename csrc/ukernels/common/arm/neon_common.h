// Advanced SIMD helpers the AArch64 kernel files share (Armv8.0 instructions only, so a file built
// with any AArch64 flags can include it): the store of one 8-column row of fp32 results.
// Internal linkage on purpose, as in neon_bf16_common.h: every kernel file has its own ISA flags,
// and a shared inline (weak) copy could be taken by the linker from a file built for a richer ISA.
#pragma once

#if !defined(__aarch64__) || !defined(__ARM_NEON)
#error "neon_common.h is for AArch64 kernel files only"
#endif

#include <arm_neon.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace cpumoe {
namespace {

// Row i of the destination, columns [0, nc) (nc <= 8) of one 8-column block: lo (columns 0-3),
// hi (4-7) (+ bias). The bias is added in vector form for full and partial rows alike (a partial
// row's nc bias values through a zero-padded copy); a partial row (the last block when
// n % 8 != 0) is stored through a stack copy.
inline void store_row_f32x8(float* d, float32x4_t lo, float32x4_t hi, int64_t nc,
                            const float* bias) {
  float v[8];
  if (bias != nullptr) {
    const float* b = bias;
    if (nc < 8) {
      std::memset(v, 0, sizeof v);
      std::memcpy(v, bias, size_t(nc) * sizeof(float));
      b = v;
    }
    lo = vaddq_f32(lo, vld1q_f32(b));
    hi = vaddq_f32(hi, vld1q_f32(b + 4));
  }
  if (nc == 8) {
    vst1q_f32(d, lo);
    vst1q_f32(d + 4, hi);
  } else {
    vst1q_f32(v, lo);
    vst1q_f32(v + 4, hi);
    std::memcpy(d, v, size_t(nc) * sizeof(float));
  }
}

}  // namespace
}  // namespace cpumoe
