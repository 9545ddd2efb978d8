// Row stores shared by the AVX-512 qgemm kernels (VNNI, and AMX for its tile rows): one row of up
// to 16 int32 columns per call, masked at the tail, epilogue in the order of qgemm_common.h.
// Internal linkage on purpose: each kernel file has its own ISA flags (see qgemm_common.h).
#pragma once

#if !defined(__AVX512F__)
#error "qgemm_avx512_common.h is for files built with AVX-512 flags only"
#endif

#include <immintrin.h>

#include <cstdint>

#include "cpumoe/qgemm.h"

namespace cpumoe {
namespace {

inline __mmask16 mask16(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

struct StoreS32 {
  int32_t* dst;
  int64_t ld;
  // Row i of the call, columns [j0, j0 + 16) of which the first nc are real.
  void operator()(int64_t i, int64_t j0, int64_t nc, __m512i v) const {
    _mm512_mask_storeu_epi32(dst + i * ld + j0, mask16(nc), v);
  }
};

struct StoreF32 {
  float* dst;
  int64_t ld;
  const QGemmEpilogue* ep;
  void operator()(int64_t i, int64_t j0, int64_t nc, __m512i v) const {
    const __mmask16 mk = mask16(nc);
    __m512 f = _mm512_cvtepi32_ps(v);
    f = _mm512_mul_ps(f, _mm512_set1_ps(ep->lhs_scale[i]));
    f = _mm512_mul_ps(f, _mm512_maskz_loadu_ps(mk, ep->rhs_scale + j0));
    if (ep->bias != nullptr) f = _mm512_add_ps(f, _mm512_maskz_loadu_ps(mk, ep->bias + j0));
    _mm512_mask_storeu_ps(dst + i * ld + j0, mk, f);
  }
};

}  // namespace
}  // namespace cpumoe
