/// @file reference.h
/// The naive oracle of the test suite: textbook loops, no packing, no threads, no vector math.
///
/// Written independently of csrc/: nothing here calls the library, except the fp32 <-> f16/bf16
/// conversions of cpumoe/dtype.h (checked on their own, exhaustively, in test_dtype.cpp) and the
/// enums of activation.h / dtype.h. The op's semantics are spelled out again in reference.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "cpumoe/activation.h"
#include "cpumoe/dtype.h"

namespace cpumoe_ref {

using cpumoe::Activation;
using cpumoe::DType;

/// C[i][j] = sum_x A[i][x] * B[j][x] in int64, returned as int32 (the test shapes fit; the
/// function aborts if a sum does not, so an overflowing test shape cannot pass by accident).
void gemm_s32(int64_t m, int64_t n, int64_t k, const int8_t* a, int64_t lda, const int8_t* b,
              int64_t ldb, int32_t* c, int64_t ldc);

/// Per-row symmetric int8 quantization: s = max(max|x|, 1e-7) / 127 (in fp32),
/// q = round_half_even(x / s) clamped to [-127, 127]. Returns s.
float quantize_row(const float* x, int64_t n, int8_t* q);

/// The gated activation of one (gate, up) pair, straight from the formulas, in double.
double activation(Activation a, double g, double u);

/// An activation override for the MoE oracle: nullptr means activation() above. The tests pass
/// the library's vector forms here to check every other step of the pipeline bit for bit.
using ActivationFn = float (*)(Activation a, float g, float u);

/// One MoE problem in plain form, all arrays dense and row-major.
struct MoeProblem {
  int64_t E = 0, H = 0, I = 0;
  std::vector<int8_t> w13;  // [E, 2I, H]
  std::vector<int8_t> w2;   // [E, H, I]
  std::vector<float> s13;   // [E, 2I]
  std::vector<float> s2;    // [E, H]
  std::vector<float> b13;   // [E, 2I] or empty (already in fp32)
  std::vector<float> b2;    // [E, H] or empty
};

/// The inputs of one call. x holds raw elements of type dtype with row stride x_stride.
struct MoeInputs {
  int64_t T = 0, k = 0;
  const void* x = nullptr;
  int64_t x_stride = 0;
  DType dtype = DType::f32;
  const float* topk_weights = nullptr;  // [T, k], row stride weights_stride
  int64_t weights_stride = 0;
  const int64_t* topk_ids = nullptr;    // [T, k], row stride ids_stride
  int64_t ids_stride = 0;
  Activation activation = Activation::silu;
  bool skip_weighted = false;
};

/// out[t * H + h], dense [T, H]: the op's result rounded to the input dtype, as fp32.
std::vector<float> fused_moe(const MoeProblem& p, const MoeInputs& in,
                             ActivationFn act_override = nullptr);

/// The BF16 op's problem: bf16 weights (raw bits), fp32 biases (or empty).
struct MoeProblemBf16 {
  int64_t E = 0, H = 0, I = 0;
  std::vector<uint16_t> w13;  // [E, 2I, H]
  std::vector<uint16_t> w2;   // [E, H, I]
  std::vector<float> b13, b2;
};

/// The BF16 op: h = bf16(x) . w13^T (sum in double, rounded once to fp32) + b13, a = act(h),
/// y = bf16(a) . w2^T + b2, fp32 combine, rounded to the input dtype.
std::vector<float> fused_moe_bf16(const MoeProblemBf16& p, const MoeInputs& in);

}  // namespace cpumoe_ref
