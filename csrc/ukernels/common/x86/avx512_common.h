// Row stores shared by the AVX-512 qgemm kernels (VNNI, and AMX for its tile rows) and the bgemm
// ones: one row of up to 16 columns per call from int32 (StoreF32, epilogue in the order of
// qgemm_common.h) or fp32 (StoreF32Acc) accumulators, masked at the tail; and the operand loads
// of the AVX-512 tiles.
// Internal linkage on purpose: each kernel file has its own ISA flags (see qgemm_common.h).
#pragma once

#if !defined(__AVX512F__)
#error "avx512_common.h is for files built with AVX-512 flags only"
#endif

#include <immintrin.h>

#include <cstdint>

#include "cpumoe/qgemm.h"
#include "ukernels/common/gemm_tile.h"

namespace cpumoe {
namespace {

inline __mmask16 mask16(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// fp32 accumulators (the bgemm kernels), + bias[j] when bias is not null. stream
// (QGemmEpilogue::stream_dst): a whole, aligned 64-byte line goes past the caches.
struct StoreF32Acc {
  float* dst;
  int64_t ld;
  const float* bias;
  bool stream = false;
  void operator()(int64_t i, int64_t j0, int64_t nc, __m512 v) const {
    const __mmask16 mk = mask16(nc);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, bias + j0));
    float* d = dst + i * ld + j0;
    if (stream && nc == 16 && (reinterpret_cast<uintptr_t>(d) & 63) == 0) _mm512_stream_ps(d, v);
    else _mm512_mask_storeu_ps(d, mk, v);
  }
};

struct StoreF32 {
  float* dst;
  int64_t ld;
  const QGemmEpilogue* ep;
  void operator()(int64_t i, int64_t j0, int64_t nc, __m512i v) const {
    __m512 f = _mm512_cvtepi32_ps(v);
    f = _mm512_mul_ps(f, _mm512_set1_ps(ep->lhs_scale[i]));
    f = _mm512_mul_ps(f, _mm512_maskz_loadu_ps(mask16(nc), ep->rhs_scale + j0));
    StoreF32Acc{dst, ld, ep->bias, ep->stream_dst}(i, j0, nc, f);
  }
};

// The operand side of gemm_tile.h's Ops for the AVX-512 kernels (int8 VNNI, bf16): blocks of 16
// columns, one zmm of B per k group, the group's 4 bytes of an A row broadcast to every lane; the
// tile shapes of that header's walk (8 x 48 and 6 x 64, within 32 zmm). A kernel's Ops adds Acc,
// zero, dot and finish.
struct Avx512TileOperands {
  static constexpr int64_t kNr = 16;
  static constexpr int kSteps = 1;
  static constexpr int64_t kAGroupBytes = 4, kBGroupBytes = 64;
  // Up to 6 rows: 64-column steps and row tiles of <= 6; more rows: 48-column steps, tiles of 8
  // (24 accumulators, 3 B vectors, 1 broadcast).
  static constexpr int kSmallRows = 6, kSmallBlocks = 4, kRows = 8, kBlocks = 3;
  template <int S>
  static __m512i load_a(const uint8_t* p) { return _mm512_set1_epi32(gemm_tile::load_i32(p)); }
  template <int S>
  static __m512i load_b(const uint8_t* p) { return _mm512_loadu_si512(p); }
};

}  // namespace
}  // namespace cpumoe
