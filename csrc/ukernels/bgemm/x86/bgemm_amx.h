// The logic of bgemm_bf16r_bf16ci16x2_16x16_amx over amx_gemm.h's Tiles class: the kernel file
// instantiates it with the hardware tiles (amx_hw.h), the tests with the tile model
// (tests_cpp/amx/amx_tile_model.h), so both run exactly this code.
//
// tdpbf16ps multiplies a 16 x 32 tile of bf16 (16 rows of A, 32 k) by a 16 x 64-byte tile of bf16
// pairs (16 groups of 2 k, each 16 columns x 2 values) into a 16 x 16 fp32 tile. Those are the
// `bf16r` / `bf16ci16x2` layouts of bgemm_bf16r_bf16ci16x2_8x16_avx512_bf16 with the depth padded
// to kp = round_up(k, 32) and the rows to a multiple of 16 (zero rows): an A tile is 16 packed rows
// at stride 2 kp bytes, a B tile 16 consecutive 64-byte groups of one column block. Every call
// runs on the AMX tiles, decode's one-row calls too (the padding rows' results are dropped): the
// hardware's fp32 rounding order is its own, so handing few-row calls to the AVX-512 BF16 tiles
// would make a row's result depend on how many rows share its call (the tester's sub-block
// check); the int8 kernel's sums are exact and it may.
// Numerics: per k pair the two exact products are summed and added to the fp32 accumulator,
// bf16 subnormals and fp32 subnormal results flushed to zero, round to nearest even (the
// hardware groups the roundings of a tile's 16 pairs its own way: within the fp32 summation
// bound of bgemm.h, and deterministic for a given shape).
// Features used: AMX-TILE, AMX-BF16 (through Tiles), AVX-512 F (epilogue).
#pragma once

#include <immintrin.h>

#include "cpumoe/bgemm.h"
#include "ukernels/bgemm/bgemm_common.h"
#include "ukernels/common/x86/amx_gemm.h"
#include "ukernels/common/x86/avx512_common.h"

namespace cpumoe {
namespace {
namespace bgemm_amx {

constexpr int64_t kMr = 16;  // rows of one AMX tile; lhs offsets are taken at multiples of it
// K pads to 32 (64 bytes: one A tile row), rows to 16; B blocks of 16 columns in pairs of k.
using Packing = BGemmPacking</*Nr=*/16, /*Kr=*/32, /*LhsBytes=*/2, /*LhsRows=*/kMr>;

struct Ops {
  using Acc = float;
  template <class Tiles, int C, int A, int B>
  static void dot() { Tiles::template dpbf16ps<C, A, B>(); }
  static __m512 finish(const float* row, const uint8_t*) { return _mm512_load_ps(row); }
};

template <class Tiles>
void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const float* bias) {
  if (m <= 0 || n <= 0) return;
  const int64_t kp = Packing::padded_k(k);
  amx::run<Tiles, Ops>(m, n, 2 * kp, static_cast<const uint8_t*>(lhs),
                       static_cast<const uint8_t*>(rhs), 2 * Packing::kNr * kp,
                       StoreF32Acc{dst, dst_stride, bias});
}

}  // namespace bgemm_amx
}  // namespace
}  // namespace cpumoe
