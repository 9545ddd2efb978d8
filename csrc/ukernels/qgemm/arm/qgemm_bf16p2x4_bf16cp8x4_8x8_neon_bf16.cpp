// qgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16: the int8 GEMM (W8A8) on BFMMLA, for CPUs with FEAT_BF16
// but without FEAT_I8MM. It has the int8 interface of every qgemm kernel and gives the SAME int32
// results as the SMMLA kernel, bit for bit, and so the same fp32 epilogue.
//
// This is how "the int8 op falls back to the BF16 kernel with weights dequantized once at
// prepack" is realised without losing exactness: pack_rhs converts the int8 weights to bf16 once
// (at prepack: every int8 value is exact in bf16, which has 8 significant bits), pack_lhs converts
// the int8 activation rows of each call to bf16 (exact too), and the dequantization by the scales
// stays in the int32 -> fp32 epilogue, as on the int8 paths. BFMMLA multiplies a 2x4 bf16 block of
// A by a 4x2 block of B^T into a 2x2 fp32 block. Over a K block of at most kKBlock = 1024, every
// partial sum is an integer with |sum| <= 1024 * 128 * 128 = 2^24, and every such integer is an
// fp32 value: no product, addition or rounding inside BFMMLA (whatever its intermediate rounding,
// round-to-odd or not, FPCR.EBF or not) can be inexact. Each block's fp32 sums are converted to
// int32 (exact) and added in int32, so the result is the exact int32 dot product for any K.
//
// Layouts, packers, register tiles and the tile driver are shared with the bf16 GEMM on BFMMLA
// (neon_bf16_common.h): A row pairs and B column pairs in 4-k slices (as SMMLA's in 8-k slices),
// K padded to 4 and N to 8 with zeros at packing; register tiles of 2x32 (m <= 2), 6x16 and 8x8
// (column tails), 16 to 24 accumulator chains. This kernel only converts int8 to bf16 in its
// packers and sums each tile over K blocks: the block loop runs from zero per block (a function
// of its own: accumulators and operands only, no spills), and the int32 totals wait in a small
// stack tile across it (one store and load per 1024 k, i.e. per 4096 BFMMLA of the 6x16 tile).
//
// Cost vs SMMLA: about half the int8 throughput (BFMMLA does half of SMMLA's MACs, bf16 weights
// take twice the bytes), the price of exactness here (llvm-mca models: docs/kernels.md).
//
// @pre m, n >= 0, k >= 1; packed buffers from this kernel's packers; A and B any int8 values.
// Features used: NEON, BF16 (BFMMLA; the int8 -> bf16 conversions use plain NEON).
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#error "qgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16.cpp needs -march=armv8.2-a+bf16 (set per file by CMake)"
#endif

#include <arm_neon.h>

#include <algorithm>
#include <cstring>

#include "cpumoe/qgemm.h"
#include "ukernels/common/arm/neon_bf16_common.h"
#include "ukernels/qgemm/arm/qgemm_neon_common.h"

namespace cpumoe {
namespace {

constexpr int64_t kMr = 8;
// A row pairs and B blocks of 8 columns, both bf16 (the `bf16p2x4` / `bf16cp8x4` layouts).
using Packing = QGemmPacking<8, kBf16pKr, 2, 2, 2>;
constexpr int64_t kKr = Packing::kKr;
// The largest K block whose fp32 partial sums are all exact integers: 1024 * 128 * 128 = 2^24.
constexpr int64_t kKBlock = 1024;
static_assert(kKBlock * 128 * 128 <= (int64_t(1) << 24), "fp32 sums of a K block must be exact");
static_assert(kKBlock % kKr == 0, "K blocks hold whole slices");

// A tile sums the whole K as exact int32: K blocks of at most kKBlock in fp32 (exact), each
// converted to int32 and added.
struct ExactInt32Sum {
  using Acc = int32x4_t;
  template <int NP, int NB>
  static void tile(const bfloat16_t* a, const bfloat16_t* b, int64_t kp,
                   int32x4_t (&acc)[NP][4 * NB]) {
    float32x4_t f[NP][4 * NB];
    bfmmla_tile<NP, NB>(a, 2 * kp, b, 8 * kp, std::min(kp, kKBlock) / kKr, f);
    for (int p = 0; p < NP; ++p)
      for (int c = 0; c < 4 * NB; ++c) acc[p][c] = vcvtq_s32_f32(f[p][c]);
    for (int64_t k0 = kKBlock; k0 < kp; k0 += kKBlock) {
      bfmmla_tile<NP, NB>(a + 2 * k0, 2 * kp, b + 8 * k0, 8 * kp, std::min(kp - k0, kKBlock) / kKr,
                          f);
      for (int p = 0; p < NP; ++p)
        for (int c = 0; c < 4 * NB; ++c) acc[p][c] = vaddq_s32(acc[p][c], vcvtq_s32_f32(f[p][c]));
    }
  }
};

void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  bfmmla_run<ExactInt32Sum>(
      m, n, k, lhs, rhs, [&](int64_t i, int64_t j0, int64_t nc, int32x4_t lo, int32x4_t hi) {
        neon_store_f32(dst + i * dst_stride + j0, lo, hi, nc, ep.lhs_scale[i], ep.rhs_scale + j0,
                       ep.bias ? ep.bias + j0 : nullptr);
      });
}

}  // namespace

extern const QGemmUkernel qgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16 = make_qgemm<Packing>(
    "qgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16", Isa::neon_bf16, kMr, bf16p2x4_pack<FromInt8>, bf16cp8x4_pack<FromInt8>, run_f32);

}  // namespace cpumoe
