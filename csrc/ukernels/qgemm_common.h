// Helpers shared by every qgemm microkernel: the scalar tail stores. Kept in one place so all
// kernels apply the epilogue in the same order, (acc * lhs_scale) * rhs_scale + bias, and their
// fp32 results agree bit for bit (the build disables FMA contraction for the same reason).
// Internal linkage on purpose: every kernel file is built with its own ISA flags, and one shared
// inline copy (a weak symbol) could be taken by the linker from a file built for AVX-512 or I8MM
// and then run, from the portable kernel, on a CPU without them.
#pragma once

#include <cstdint>
#include <cstring>

namespace cpumoe {
namespace {

/// The `qs8r` lhs layout: row i at i * kp bytes, zero-padded from k to kp.
inline void pack_lhs_qs8r(int64_t m, int64_t k, int64_t kp, const int8_t* const* rows,
                          int8_t* dst) {
  for (int64_t i = 0; i < m; ++i) {
    std::memcpy(dst + i * kp, rows[i], size_t(k));
    std::memset(dst + i * kp + k, 0, size_t(kp - k));
  }
}

inline void store_s32_row(int32_t* dst, const int32_t* acc, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = acc[j];
}

inline void store_f32_row(float* dst, const int32_t* acc, int64_t n, float lhs_scale,
                          const float* rhs_scale, const float* bias) {
  if (bias != nullptr) {
    for (int64_t j = 0; j < n; ++j) dst[j] = float(acc[j]) * lhs_scale * rhs_scale[j] + bias[j];
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = float(acc[j]) * lhs_scale * rhs_scale[j];
  }
}

}  // namespace
}  // namespace cpumoe
