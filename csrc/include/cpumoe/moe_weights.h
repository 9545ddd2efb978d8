/// @file moe_weights.h
/// The prepack inputs of the fused-MoE ops: a layer's expert weights as a checkpoint gives them
/// (int8 with per-channel scales, 4-bit with group scales, bf16, fp8 with block scales), dense and
/// row-major, with
/// optional biases. Read once by the packed classes (packed.h); never kept.
#pragma once

#include <cstdint>

#include "cpumoe/dtype.h"
#include "cpumoe/f8gemm.h"
#include "cpumoe/q4gemm.h"
#include "cpumoe/weight_format.h"

namespace cpumoe {

/// How the W4A8 op quantizes its int8 activations (the GEMM inputs: the tokens, then the
/// activated rows).
enum class ActQuant : int32_t {
  /// One scale per row: s = max|row| / 127.
  row = 0,
  /// One scale per row and weight group (the group_size consecutive k that share a weight
  /// scale; GGUF's blocks of 32 at g = 32): s = max|block| / 127, closer values where a row's
  /// magnitudes vary along k, for one more multiply per group in the kernels.
  group = 1,
};

/// Plain (unpacked) int8 expert weights as given by a checkpoint; all arrays dense, row-major.
struct MoeWeights {
  int64_t num_experts = 0;   ///< E
  int64_t hidden = 0;        ///< H
  int64_t intermediate = 0;  ///< I
  const int8_t* w13 = nullptr;  ///< [E, 2I, H]; rows [0, I) gate, [I, 2I) up (swigluoai: even/odd)
  const int8_t* w2 = nullptr;   ///< [E, H, I]
  const float* s13 = nullptr;   ///< [E, 2I] per-output-channel scales, finite and > 0
  const float* s2 = nullptr;    ///< [E, H]
  const void* b13 = nullptr;    ///< [E, 2I] or nullptr, of type b13_dtype
  DType b13_dtype = DType::f32;
  const void* b2 = nullptr;     ///< [E, H] or nullptr, of type b2_dtype
  DType b2_dtype = DType::f32;
};

/// Plain bf16 expert weights (raw bf16 bit patterns), the layout of MoeWeights without scales.
struct MoeWeightsBf16 {
  int64_t num_experts = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  const uint16_t* w13 = nullptr;  ///< [E, 2I, H] bf16
  const uint16_t* w2 = nullptr;   ///< [E, H, I] bf16
  const void* b13 = nullptr;      ///< [E, 2I] or nullptr, of type b13_dtype
  DType b13_dtype = DType::f32;
  const void* b2 = nullptr;       ///< [E, H] or nullptr, of type b2_dtype
  DType b2_dtype = DType::f32;
};

/// Plain 4-bit expert weights (W4A8) in the input form of their `format`, as weight_format.h
/// states above WeightFormat: w13 / s13 for [E, 2I, H], w2 / s2 for [E, H, I].
/// g = group_size: as the format's row of kWeightFormatTable allows, dividing H and I.
/// int4_affine: w13 / w2 uint8 codes, s13 / s2 fp32 (scale, min) pairs [E, N, K / g, 2].
struct MoeWeightsW4 {
  int64_t num_experts = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  W4Format format = W4Format::int4;
  int64_t group_size = 32;
  const void* w13 = nullptr;
  const void* w2 = nullptr;
  const void* s13 = nullptr;
  const void* s2 = nullptr;
  const void* b13 = nullptr;  ///< [E, 2I] or nullptr, of type b13_dtype
  DType b13_dtype = DType::f32;
  const void* b2 = nullptr;   ///< [E, H] or nullptr, of type b2_dtype
  DType b2_dtype = DType::f32;
  ActQuant act_quant = ActQuant::row;  ///< the activations' quantization (kept by the packed layer)
};

/// Plain FP8 expert weights (W8A16): E4M3 codes with an fp32 scale per block of block_n output
/// channels x block_k inputs, the fp8 row of weight_format.h. block_k is a multiple of
/// kF8BlockMultiple or >= the depth of a matrix (one block along it; block_k = 0: always one,
/// per output channel with block_n = 1).
struct MoeWeightsFp8 {
  int64_t num_experts = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t block_n = 128;  ///< >= 1
  int64_t block_k = 128;  ///< >= 0 (0: the whole depth)
  const uint8_t* w13 = nullptr;  ///< [E, 2I, H] E4M3 codes (code_bits 4: codebook indices)
  const uint8_t* w2 = nullptr;   ///< [E, H, I]
  /// 8: w13 / w2 hold E4M3 codes and every scale is >= 0. 4 (W4A16: 4-bit weights with bf16
  /// activations): they hold indices 0..15 into `codebook`, one per byte, the weight
  /// e4m3(codebook[index]) times its block scale, which may then have either sign (a 4-bit
  /// codebook has no sign to spare). Kernels with F8GemmUkernel::codes4 keep the indices (half
  /// the bytes); the others get the codes.
  int code_bits = 8;
  const uint8_t* codebook = nullptr;  ///< code_bits 4: 16 E4M3 codes, none NaN, one a zero
  const float* s13 = nullptr;    ///< [E, ceil(2I / block_n), ceil(H / block_k)]
  const float* s2 = nullptr;     ///< [E, ceil(H / block_n), ceil(I / block_k)]
  const void* b13 = nullptr;     ///< [E, 2I] or nullptr, of type b13_dtype
  DType b13_dtype = DType::f32;
  const void* b2 = nullptr;      ///< [E, H] or nullptr, of type b2_dtype
  DType b2_dtype = DType::f32;
};

}  // namespace cpumoe
