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
#include "cpumoe/moe_weights.h"  // ActQuant
#include "cpumoe/q4gemm.h"  // W4Format only

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
double activation(const cpumoe::ActivationSpec& a, double g, double u);

/// An activation override for the MoE oracle: nullptr means activation() above. The tests pass
/// the library's vector forms here to check every other step of the pipeline bit for bit.
using ActivationFn = float (*)(const cpumoe::ActivationSpec& a, float g, float u);

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
  cpumoe::ActivationSpec activation = Activation::silu;
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

using cpumoe::W4Format;

/// The int8 value of code @p code of format @p f, from the format's definition: int4 a
/// two's-complement nibble (0..15); mxfp4 2 * E2M1 (sign bit 3, exponent bits 2-1, mantissa
/// bit 0); int4_affine code - 8 (0..15; its min enters as the offset min + 8 * scale: see
/// gemm_w4); int8_affine code - 128 (0..255; offset min + 128 * scale).
int8_t w4_value(W4Format f, uint8_t code);

/// The fp32 value of a group scale as the kernels take it: int4 and int8_affine the float
/// itself; mxfp4 2^(e - 128) (the factor 1/2 of the doubled values folded in), NaN for e = 255.
float w4_scale(W4Format f, const void* scales, int64_t idx);

/// The kernels' GEMM of q4gemm.h (format: what the kernel decodes, int4, mxfp4 or, with 8-bit
/// codes, int8_affine): for each (i, j), exact int32 sums per group of g k of A times the
/// values (w4_value), then acc = acc + float(isum_g) * scale(j, g) in fp32 over g in order (with
/// lhs_group_scale, row stride k / g: acc + (float(isum_g) * scale(j, g)) *
/// lhs_group_scale[i][g]), dst = acc * lhs_scale[i] (+ bias[j]). codes [n][k] one per byte (row
/// stride ldc; 4-bit formats: the low nibble); scales [n][k / g] (row stride lds elements of
/// the kernel's scale type, w4_scale); bias nullable.
void gemm_w4_kernel(int64_t m, int64_t n, int64_t k, W4Format f, int64_t g, const int8_t* a,
                    int64_t lda, const uint8_t* codes, int64_t ldc, const void* scales,
                    int64_t lds, const float* lhs_scale, const float* bias, float* dst,
                    int64_t ldd, const float* lhs_group_scale = nullptr);

/// The W4A8 GEMM of a layer of format @p f: gemm_w4_kernel, with the affine formats' (scale, min)
/// pairs (lds pairs per row): the kernel's sums with the scales, then + (sum_g float(asum_g) *
/// offset_g) * lhs_scale[i], the sum fp32 from 0 over g in order, asum_g the exact sum of a's
/// row over the group (times lhs_group_scale[i][g] when given), offset_g = min_g + 8 * scale_g
/// (int4_affine) or min_g + 128 * scale_g (int8_affine).
/// int8_affine with @p int8_planes (the kernels without 8-bit codes, cpumoe::W4Plan): the
/// int4_affine GEMM of the hi nibbles with (16 scale, min) and the bias, plus (fp32) that of
/// the lo nibbles with (scale, 0), no bias.
void gemm_w4(int64_t m, int64_t n, int64_t k, W4Format f, int64_t g, const int8_t* a, int64_t lda,
             const uint8_t* codes, int64_t ldc, const void* scales, int64_t lds,
             const float* lhs_scale, const float* bias, float* dst, int64_t ldd,
             const float* lhs_group_scale = nullptr, bool int8_planes = false);

/// A W4A8 MoE problem: codes [E, 2I, H] / [E, H, I] one per byte, scales [E, 2I, H / g] /
/// [E, H, I / g] (fp32 for int4, E8M0 bytes for mxfp4, fp32 (scale, min) pairs for the affine
/// formats), fp32 biases or empty.
struct MoeProblemW4 {
  int64_t E = 0, H = 0, I = 0;
  W4Format format = W4Format::int4;
  int64_t group = 32;
  cpumoe::ActQuant act_quant = cpumoe::ActQuant::row;  // group: activations per weight group
  bool int8_planes = false;  // int8_affine as the kernels without 8-bit codes run it (gemm_w4)
  std::vector<uint8_t> w13, w2;
  std::vector<uint8_t> s13, s2;  // raw scale bytes
  std::vector<float> b13, b2;
};

/// The W4A8 op: the W8A8 op's pipeline with gemm_w4 for both GEMMs (ActQuant::group: each
/// GEMM input row quantized per weight group, the scales as gemm_w4's lhs_group_scale, row
/// scale 1).
std::vector<float> fused_moe_w4(const MoeProblemW4& p, const MoeInputs& in,
                                ActivationFn act_override = nullptr);

/// The value of the E4M3 (OCP float8 e4m3fn) code @p code, from its bit fields: sign bit 7,
/// exponent bits 6-3 (bias 7), mantissa bits 2-0; exponent 0 subnormal (m * 2^-9); 0x7F and 0xFF
/// NaN. Built from the fp32 bit pattern (normal codes) and an exact scaling (subnormals).
float e4m3(uint8_t code);

/// The nearest E4M3 code of @p v (ties: the even code; |v| > 448 saturates to +-448; the sign
/// bit of v kept, so -0 is 0x80): e4m3(e4m3_code(v)) == v for every v E4M3 holds.
uint8_t e4m3_code(float v);

/// The W8A16 FP8 GEMM of f8gemm.h, as its formula is written: for each (i, j), per group of
/// gk = (group >= k ? k : group) consecutive k (the last one shorter), S = the exact products
/// bf16(a) * e4m3(code) summed in double and rounded once to fp32; acc = acc + S * s in fp32 over
/// the groups in order from acc = 0, s = scales[(j / block_n) * lds + g]; dst = acc (+ bias[j]).
/// a [m][k] bf16 bits (row stride lda), codes [n][k] (row stride ldc), bias nullable. When @p mag
/// is not null, mag[i * ldd + j] = sum over groups of |s| * sum |products| (double): the scale of
/// the fp32 rounding error a kernel may make (its own summation order within a group).
void gemm_f8(int64_t m, int64_t n, int64_t k, int64_t group, int64_t block_n, const uint16_t* a,
             int64_t lda, const uint8_t* codes, int64_t ldc, const float* scales, int64_t lds,
             const float* bias, float* dst, int64_t ldd, double* mag = nullptr);

/// The BF16 op on FP8 weights: E4M3 codes with fp32 scales per block of block_n rows x block_k
/// k (block_k 0: the whole depth), fp32 biases (or empty).
struct MoeProblemFp8 {
  int64_t E = 0, H = 0, I = 0, block_n = 128, block_k = 128;
  std::vector<uint8_t> w13;  // [E, 2I, H]
  std::vector<uint8_t> w2;   // [E, H, I]
  std::vector<float> s13;    // [E, ceil(2I / block_n), ceil(H / block_k)]
  std::vector<float> s2;     // [E, ceil(H / block_n), ceil(I / block_k)]
  std::vector<float> b13, b2;
};

/// fused_moe_bf16 with each GEMM gemm_f8's (bf16(x), and bf16 of the activation, times the
/// E4M3 weights per block), fp32 combine, rounded to the input dtype.
std::vector<float> fused_moe_fp8(const MoeProblemFp8& p, const MoeInputs& in);

}  // namespace cpumoe_ref
