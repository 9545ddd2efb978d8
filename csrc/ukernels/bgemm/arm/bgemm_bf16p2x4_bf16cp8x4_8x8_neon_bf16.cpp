// bgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16: the bf16 GEMM on BFMMLA (FEAT_BF16), the Arm kernel of
// the BF16 MoE op and the baseline the int8 kernels are measured against.
//
// BFMMLA multiplies a 2x4 bf16 block of A by a 4x2 block of B^T into a 2x2 fp32 block. The
// layouts, the register tiles and the driver are those of the exact int8 kernel on BFMMLA
// (neon_bf16_common.h): A row pairs and B column pairs in 4-k slices, mr x nr = 8 x 8 as packing
// and offset units, register tiles of 2x32 (m <= 2), 6x16 and 8x8 (column tails) with 16 to 24
// independent accumulator chains. Here the inputs are bf16 already, so packing only interleaves
// (8 k of a row pair per two q stores), and each accumulator sums the whole K in fp32 from zero;
// the epilogue adds the bias. Every output element is summed the same way whatever the tile or the
// call's m, n and offsets, so a token's result does not depend on how many share its expert.
//
// Numerics (FEAT_BF16 without FEAT_EBF16, or with FPCR.EBF = 0, the default): each BFMMLA output
// is acc + (a0 b0 + a1 b1), then + (a2 b2 + a3 b3), every addition rounded to odd in fp32, with
// subnormal inputs and results flushed to zero. The products of two bf16 are exact in fp32.
// Round to odd is faithful (error below 1 ulp, u = 2^-23, twice round-to-nearest's), but the
// pairing halves the chain: a product passes through at most ceil(k/2) roundings (its pair sum
// and the accumulator additions after it; the first addition to zero is exact, zero pairs of the
// padding are exact too). So |error| <= ~ceil(k/2) * 2^-23 * sum|a b| <= (k + 1) * 2^-24 * sum|ab|,
// plus one round-to-nearest bias addition (2^-24 * |result|): within the fp32 bound
// (k + 2) * 2^-24 * (sum|a b| + |bias|) that bgemm_tester.h checks, to first order. Flushing adds
// an absolute error below 2^-126 per operation for tiny products and sums; subnormal bf16 inputs
// count as zero (bgemm.h allows it).
//
// @pre m, n >= 0, k >= 1; packed buffers from this kernel's packers.
// Features used: NEON, BF16 (BFMMLA).
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#error "bgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16.cpp needs -march=armv8.2-a+bf16 (set per file by CMake)"
#endif

#include <arm_neon.h>

#include <cstdint>
#include <cstring>

#include "cpumoe/bgemm.h"
#include "ukernels/common/arm/neon_bf16_common.h"
#include "ukernels/common/arm/neon_common.h"  // store_row_f32x8

namespace cpumoe {
namespace {

constexpr int64_t kMr = 8;
constexpr int64_t kNr = 8;

// bf16 sources: packing only moves them (bf16p2x4_pack / bf16cp8x4_pack in the table below).
struct FromBf16 {
  static uint16x8_t eight(const uint16_t* p) { return vld1q_u16(p); }
  static uint16_t one(uint16_t v) { return v; }
};

// A tile sums the whole K in fp32.
struct Fp32Sum {
  using Acc = float32x4_t;
  template <int NP, int NB>
  static void tile(const bfloat16_t* a, const bfloat16_t* b, int64_t kp,
                   float32x4_t (&acc)[NP][4 * NB]) {
    bfmmla_tile<NP, NB>(a, 2 * kp, b, 8 * kp, kp / kBf16pKr, acc);
  }
};

void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const float* bias) {
  bfmmla_run<Fp32Sum>(m, n, k, lhs, rhs,
                      [&](int64_t i, int64_t j, int64_t nc, float32x4_t lo, float32x4_t hi) {
                        store_row_f32x8(dst + i * dst_stride + j, lo, hi, nc,
                                        bias != nullptr ? bias + j : nullptr);
                      });
}

}  // namespace

extern const BGemmUkernel bgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16 = {
    "bgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16",
    Isa::neon_bf16,
    kMr,
    kNr,
    kBf16pKr,
    bf16p2x4_size,
    bf16p2x4_offset,
    bf16p2x4_pack<FromBf16>,
    bf16cp8x4_size,
    bf16cp8x4_offset,
    bf16cp8x4_pack<FromBf16>,
    run_f32,
};

}  // namespace cpumoe
