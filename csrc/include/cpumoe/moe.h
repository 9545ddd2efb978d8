/// @file moe.h
/// The fused-MoE ops: prepack the experts' weights once, then run
///   out[t] = sum_j w[t,j] * FFN_{ids[t,j]}(x[t])
/// W8A8 (fused_moe_int8): int8 weights with per-channel scales, dynamic per-token int8
/// quantization of the activations, GEMM1 (w13), a gated activation, requantization, GEMM2 (w2)
/// and the weighted combine. W4A8 (fused_moe_int8 on a PackedMoeW4): the same with 4-bit weights
/// (the q4gemm formats of weight_format.h) and one scale per group of k (q4gemm.h). BF16
/// (fused_moe_bf16): bf16 weights, the same pipeline with the GEMM inputs rounded to bf16
/// instead of quantized. The whole chain (GEMM kernel, row operations, tile policy: a MoeConfig)
/// is chosen once, at prepack, for this CPU (int8_config / bf16_config), and stored in the
/// packed layer; the MoE code knows the kernels only through their interfaces.
///
/// Errors in the arguments throw cpumoe::ArgumentError (a std::invalid_argument) whose message
/// names the argument; nothing is written to the output then.
///
/// This header holds the call (MoeCall) and the ops; it includes the rest of the public MoE API:
/// moe_config.h (errors, tile policy, the chain), moe_weights.h (prepack inputs), packed.h (the
/// packed layers).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpumoe/activation.h"
#include "cpumoe/dtype.h"
#include "cpumoe/moe_config.h"   // ArgumentError, MoeConfig, the *_config functions
#include "cpumoe/moe_weights.h"  // the prepack inputs
#include "cpumoe/packed.h"       // the packed layers

namespace cpumoe {

/// One call of the op. Rows of x and out may be strided (row stride >= H); elements within a row
/// are contiguous.
struct MoeCall {
  int64_t num_tokens = 0;  ///< T >= 0
  int64_t topk = 0;        ///< k >= 1
  const void* x = nullptr;  ///< [T, H] of type dtype
  int64_t x_row_stride = 0;
  DType dtype = DType::f32;
  const float* topk_weights = nullptr;  ///< [T, k]
  int64_t topk_weights_row_stride = 0;
  const void* topk_ids = nullptr;       ///< [T, k], int32 or int64 (topk_ids_int64)
  bool topk_ids_int64 = false;
  int64_t topk_ids_row_stride = 0;
  /// Expert parallelism: when set, topk_ids are global ids in [0, num_global_experts) and
  /// expert_map[g] is the local expert (in [0, E) of the packed weights) or -1 for an expert that
  /// is not here: such slots contribute nothing and cost nothing.
  const int32_t* expert_map = nullptr;
  int64_t num_global_experts = 0;
  /// The gated activation with its parameters (activation.h); a spec that fails
  /// activation_spec_problem() is an ArgumentError.
  ActivationSpec activation = Activation::silu;
  bool skip_weighted = false;  ///< only with k == 1: the router weight is already in x
  void* out = nullptr;         ///< [T, H] of type dtype; must not overlap x
  int64_t out_row_stride = 0;
  int num_threads = 0;         ///< <= 0: the OpenMP default (OMP_NUM_THREADS)
};

/// Runs the op. Deterministic: the result does not depend on num_threads (which is capped at
/// max(256, processors, OMP_NUM_THREADS)).
/// Throws ArgumentError for bad arguments (expert id outside [0, E), k < 1, skip_weighted with
/// k > 1, out overlapping an input, sizes whose products overflow, ...) before writing anything.
/// topk_ids and expert_map are read once more for routing, each entry once, and what was read is
/// checked: another thread rewriting them during the call gets an ArgumentError (out may then be
/// partly written), never an out-of-range access.
///
/// Values: an id repeated in a row is two slots (its expert's output is added twice, with each
/// weight); k > E is allowed that way. A token whose x holds a NaN or an infinity gets NaN in every
/// element of its output (its quantization scale is NaN / inf; other tokens are unaffected); NaN or
/// inf router weights and biases propagate through the fp32 arithmetic as written in the
/// semantics. An all-zero token quantizes to zeros (scale from kAmaxFloor).
///
/// Scratch: the buffers of a call live in a block owned by the calling thread, grown to the
/// largest call so far and reused by the next ones (at most fused_moe_scratch_bytes() of the
/// largest call). Calls from different threads never share scratch.
void fused_moe_int8(const PackedMoe& packed, const MoeCall& call);
/// The W4A8 op: fused_moe_int8's pipeline, validation, threads and scratch, with both GEMMs on
/// 4-bit weights (q4gemm.h's arithmetic: exact int32 sums per group, fp32 over groups in
/// increasing order, then the token's scale and the bias). Deterministic for any thread count and
/// the same bits on every kernel.
void fused_moe_int8(const PackedMoeW4& packed, const MoeCall& call);

/// The BF16 op: the same routing, activation, combine, strides, validation, expert map, thread
/// and scratch behaviour as fused_moe_int8, with no quantization:
///   h = bf16(x) . w13^T + b13 (fp32 accumulation), a = act(h) in fp32,
///   y = bf16(a) . w2^T + b2, out[t] = sum_j w[t,j] * y[slot(t,j)] in fp32, stored in x's dtype.
/// bf16(v) rounds to nearest even (x of dtype bf16 is used as is). Deterministic for a given
/// kernel and thread-count independent; kernels of different ISAs may differ in the last bits of
/// their fp32 sums. Non-finite values propagate as IEEE arithmetic makes them (a NaN in x gives
/// a NaN row). Throws ArgumentError for bad arguments before writing anything.
void fused_moe_bf16(const PackedMoeBf16& packed, const MoeCall& call);
/// The BF16 op on FP8 weights (W8A16): the same pipeline, with each GEMM on E4M3 weights and
/// their block scales (f8gemm.h's arithmetic: fp32 sums per block, each times its scale, summed
/// over the blocks in increasing order, then the bias). Deterministic for a given kernel and
/// thread-count independent; kernels of different ISAs may differ in the last bits.
void fused_moe_bf16(const PackedMoeFp8& packed, const MoeCall& call);

/// Upper bound of the scratch bytes one call of @p num_tokens tokens and @p topk slots each
/// needs, whatever the routing (tokens are processed in chunks, so this stops growing beyond
/// one chunk: 16384 slots). 0 for num_tokens == 0. @p num_threads as in MoeCall.
size_t fused_moe_scratch_bytes(const PackedMoe& packed, int64_t num_tokens, int64_t topk,
                               int num_threads = 0);
/// The same bound for weights of E x H x I packed for @p kernel, without packing them.
size_t fused_moe_scratch_bytes(const QGemmUkernel& kernel, int64_t num_experts, int64_t hidden,
                               int64_t intermediate, int64_t num_tokens, int64_t topk,
                               int num_threads = 0);
/// The bounds of W4A8 calls; the kernel's bound holds for any format and group a layer of
/// these sizes can have (the kernels' own scratch depends on them, and is part of the bound).
size_t fused_moe_scratch_bytes(const PackedMoeW4& packed, int64_t num_tokens, int64_t topk,
                               int num_threads = 0);
size_t fused_moe_scratch_bytes(const Q4GemmUkernel& kernel, int64_t num_experts, int64_t hidden,
                               int64_t intermediate, int64_t num_tokens, int64_t topk,
                               int num_threads = 0);
/// The bounds of fused_moe_bf16 calls.
size_t fused_moe_scratch_bytes(const PackedMoeBf16& packed, int64_t num_tokens, int64_t topk,
                               int num_threads = 0);
size_t fused_moe_scratch_bytes(const BGemmUkernel& kernel, int64_t num_experts, int64_t hidden,
                               int64_t intermediate, int64_t num_tokens, int64_t topk,
                               int num_threads = 0);
/// The bounds of fused_moe_bf16 calls on fp8 weights; the kernel's holds for any block shape.
size_t fused_moe_scratch_bytes(const PackedMoeFp8& packed, int64_t num_tokens, int64_t topk,
                               int num_threads = 0);
size_t fused_moe_scratch_bytes(const F8GemmUkernel& kernel, int64_t num_experts, int64_t hidden,
                               int64_t intermediate, int64_t num_tokens, int64_t topk,
                               int num_threads = 0);
/// Bytes of scratch the calling thread holds now (0 before its first call).
size_t thread_scratch_bytes();
/// Frees the calling thread's scratch (the next call allocates it again).
void release_thread_scratch();

/// Dynamic symmetric per-row int8 quantization, as the op does it:
/// s = max(max|x|, kAmaxFloor) / 127, q = round_half_even(x / s) clamped to [-127, 127].
/// Reads @p n elements of type @p dt; writes q[0..n) and returns s.
float quantize_row(const void* x, DType dt, int64_t n, int8_t* q);

}  // namespace cpumoe
