// rowops_neon_bf16: rowops_portable's NEON backend (rowops_neon.h) with the bf16 rounding done
// by FEAT_BF16's BFCVTN (8 instructions per 4 lanes of the integer rule down to 1, plus a shift
// back to fp32 where the rounded value is used again). The bits are those of f32_to_bf16: BFCVT
// rounds to nearest even under the default FPCR (Linux starts threads with RMode = RNE, FZ = 0,
// DN = 0: subnormals kept, overflow to inf), and a NaN keeps its sign and top payload bits with
// the quiet bit set, which is f32_to_bf16's (u >> 16) | 0x40. The test suite checks every bit
// pattern against the scalar definitions.
// Level neon_bf16. Features used: NEON, BF16.
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#error "rowops_neon_bf16.cpp needs -march=armv8.2-a+bf16 (set per file by CMake)"
#endif

#include "ukernels/rowops/arm/rowops_neon.h"

namespace cpumoe {
namespace {

// Internal linkage (rowops_vec.h): every template instantiated with it is local to this file,
// built with +bf16.
struct NeonBf16 : rowops_vec::Neon {
  static constexpr bool kBf16Cvt = true;
  static CPUMOE_ROWOPS_INLINE V bf16_round(V v) { return vcvt_f32_bf16(vcvt_bf16_f32(v)); }
  static CPUMOE_ROWOPS_INLINE H bf16_narrow(V v) { return vreinterpret_u16_bf16(vcvt_bf16_f32(v)); }
  static CPUMOE_ROWOPS_INLINE H2 bf16_narrow2(V a, V b) {
    return vreinterpretq_u16_bf16(vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(a), b));
  }
};

}  // namespace

extern const RowOps rowops_neon_bf16 =
    rowops_vec::make_rowops<NeonBf16>("rowops_neon_bf16", Isa::neon_bf16);

}  // namespace cpumoe
