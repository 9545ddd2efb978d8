// rowops_neon_bf16: the NEON row operations of cpumoe/quantize.h with the bf16 rounding done by
// FEAT_BF16's BFCVTN (8 instructions per 4 lanes of the integer rule down to 1, plus a shift back
// to fp32 where the rounded value is used again). The bits are those of f32_to_bf16: BFCVT
// rounds to nearest even under the default FPCR (Linux starts threads with RMode = RNE, FZ = 0,
// DN = 0: subnormals kept, overflow to inf), and a NaN keeps its sign and top payload bits with
// the quiet bit set, which is f32_to_bf16's (u >> 16) | 0x40. The test suite checks every bit
// pattern against the scalar definitions.
// Everything without a bf16 rounding (quantization, the f32 / f16 rows) is rowops_portable's.
// Level neon_bf16. Features used: NEON, BF16.
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#error "rowops_neon_bf16.cpp needs -march=armv8.2-a+bf16 (set per file by CMake)"
#endif

#include <arm_neon.h>

#include "cpumoe/quantize.h"
#include "cpumoe/rowops.h"

namespace cpumoe {

extern const RowOps rowops_portable;

namespace {

// The policy of quantize.h's NEON loops (IntegerBf16's interface). Its internal linkage makes
// every quantize.h template instantiated with it local to this file, built with +bf16.
struct Bfcvt {
  static CPUMOE_NEON_INLINE float32x4_t round4(float32x4_t v) {
    return vcvt_f32_bf16(vcvt_bf16_f32(v));
  }
  static CPUMOE_NEON_INLINE uint16x4_t narrow4(float32x4_t v) {
    return vreinterpret_u16_bf16(vcvt_bf16_f32(v));
  }
  static CPUMOE_NEON_INLINE uint16x8_t narrow8(float32x4_t a, float32x4_t b) {
    return vreinterpretq_u16_bf16(vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(a), b));
  }
};

float activate_round(Activation act, const float* row, int64_t inter, DType dt, float* a) {
  if (dt != DType::bf16) return rowops_portable.activate_round(act, row, inter, dt, a);
  return rowops::detail::activate_round<DType::bf16, Bfcvt>(act, row, inter, a);
}

void activate_bf16(Activation act, const float* row, int64_t inter, uint16_t* out) {
  rowops::detail::activate_bf16<Bfcvt>(act, row, inter, out);
}

void weighted_sum_pass(int nj, const float* const* ys, const float* ws, int64_t n, bool first,
                       bool last, DType dt, void* dst, float* acc) {
  rowops::with_slot_count(nj, [&](auto kNj) {
    rowops::detail::weighted_sum_pass<kNj(), Bfcvt>(ys, ws, n, first, last, dt, dst, acc);
  });
}

float quantize(const void* x, DType dt, int64_t n, int8_t* q) {
  return rowops_portable.quantize(x, dt, n, q);
}
float quantize_with_amax(const float* a, int64_t n, float amax, int8_t* q) {
  return rowops_portable.quantize_with_amax(a, n, amax, q);
}
void to_bf16(const void* x, DType dt, int64_t n, uint16_t* out) {
  rowops_portable.to_bf16(x, dt, n, out);
}

}  // namespace

extern const RowOps rowops_neon_bf16 = {
    "rowops_neon_bf16", Isa::neon_bf16, quantize,         activate_round, quantize_with_amax,
    activate_bf16,      to_bf16,        weighted_sum_pass,
};

}  // namespace cpumoe
