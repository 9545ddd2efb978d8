// Row stores shared by the AVX2 kernels (the int8 qgemm one and the bf16 bgemm one): one row of
// up to 8 columns per call from int32 (StoreF32, with the epilogue in the order of
// qgemm_common.h) or fp32 (StoreF32Acc) accumulators, vpmaskmov at the tail (nothing past n is
// written).
// Internal linkage on purpose: each kernel file has its own ISA flags (see qgemm_common.h).
#pragma once

#if !defined(__AVX2__)
#error "avx2_common.h is for files built with AVX2 flags only"
#endif

#include <immintrin.h>

#include <cstdint>

#include "cpumoe/qgemm.h"  // QGemmEpilogue

namespace cpumoe {
namespace {

/// All-ones in the lanes [0, nc).
inline __m256i lane_mask(int64_t nc) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(nc)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// fp32 accumulators (the bgemm kernel), + bias[j] when bias is not null.
struct StoreF32Acc {
  float* dst;
  int64_t ld;
  const float* bias;
  void operator()(int64_t i, int64_t j0, int64_t nc, __m256 v) const {
    float* d = dst + i * ld + j0;
    if (nc >= 8) {
      if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j0));
      _mm256_storeu_ps(d, v);
    } else {
      const __m256i mk = lane_mask(nc);
      if (bias != nullptr) v = _mm256_add_ps(v, _mm256_maskload_ps(bias + j0, mk));
      _mm256_maskstore_ps(d, mk, v);
    }
  }
};

struct StoreF32 {
  float* dst;
  int64_t ld;
  const QGemmEpilogue* ep;
  void operator()(int64_t i, int64_t j0, int64_t nc, __m256i v) const {
    const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(ep->lhs_scale[i]));
    const __m256 rs = nc >= 8 ? _mm256_loadu_ps(ep->rhs_scale + j0)
                              : _mm256_maskload_ps(ep->rhs_scale + j0, lane_mask(nc));
    StoreF32Acc{dst, ld, ep->bias}(i, j0, nc, _mm256_mul_ps(f, rs));
  }
};

}  // namespace
}  // namespace cpumoe
