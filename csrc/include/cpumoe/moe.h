/// @file moe.h
/// The fused-MoE ops: prepack the experts' weights once, then run
///   out[t] = sum_j w[t,j] * FFN_{ids[t,j]}(x[t])
/// W8A8 (fused_moe_int8): int8 weights with per-channel scales, dynamic per-token int8
/// quantization of the activations, GEMM1 (w13), a gated activation, requantization, GEMM2 (w2)
/// and the weighted combine. W4A8 (fused_moe_int8 on a PackedMoeW4): the same with 4-bit weights
/// (int4 or mxfp4) and one scale per group of k (q4gemm.h). BF16 (fused_moe_bf16): bf16 weights,
/// the same pipeline with the GEMM inputs rounded to bf16 instead of quantized. The whole chain (GEMM kernel, row operations,
/// tile policy: a MoeConfig) is chosen once, at prepack, for this CPU (int8_config / bf16_config),
/// and stored in the packed layer; the MoE code knows the kernels only through their interfaces.
///
/// Errors in the arguments throw cpumoe::ArgumentError (a std::invalid_argument) whose message
/// names the argument; nothing is written to the output then.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "cpumoe/activation.h"
#include "cpumoe/bgemm.h"
#include "cpumoe/dtype.h"
#include "cpumoe/q4gemm.h"
#include "cpumoe/qgemm.h"
#include "cpumoe/rowops.h"  // MoeConfig, kAmaxFloor
#include "cpumoe/weight_format.h"

namespace cpumoe {

/// A bad argument value or shape: the message starts with the argument's name.
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// The hidden and intermediate sizes must be multiples of this (the rule every path shares; a
/// kernel that wants more pads internally).
constexpr int64_t kDimMultiple = 8;
// kAmaxFloor (the floor of a row's absolute maximum in quantization) comes from rowops.h.

/// How a layer cuts each GEMM into tasks over (expert, row chunk, column tile): part of its config.
/// The tasks, and so the order of every floating-point operation, follow from it and the routing.
struct MoeTilePolicy {
  int64_t rows = 256;  ///< rows of a task before rounding up to the kernel's mr: weights stream
                       ///< once per call for realistic tokens per expert, a huge expert still
                       ///< splits (column tiles are multiples of the kernel's nr)
  int64_t max_cols = 256;        ///< a column tile spans at most about this many columns (L2)
  int64_t tasks_per_thread = 4;  ///< ... and is small enough for about this many tasks per thread
  /// Calls with at least tasks_per_thread row tasks (expert, row chunk) per thread run GEMM1, the
  /// activation and the packing for GEMM2 in one task per row chunk, over all 2I columns, so
  /// GEMM1's output is read back from the core's cache instead of memory; smaller calls (decode)
  /// keep the column tiles that spread GEMM1 over the threads. Same results either way (every
  /// element is computed by the same kernel code in the same order); false: never.
  bool fuse_gemm1 = true;
  /// With fuse_gemm1 in effect, each row task also runs GEMM2 over all H columns of its rows:
  /// the whole call is one parallel loop, with no barrier between the GEMMs (at decode the
  /// team is woken once instead of twice and no thread waits for the slowest GEMM1 task).
  /// Same results either way; false: GEMM2 in column tiles after all row tasks.
  bool fuse_gemm2 = true;
};

/// The whole chain a packed layer runs, chosen once when it is packed and never looked up again
/// (XNNPACK's per-family config): the GEMM kernel, the row operations that go with its ISA level
/// (rowops_for), and the tile policy.
template <class Kernel>
struct MoeConfig {
  const Kernel* gemm = nullptr;
  const RowOps* rowops = nullptr;
  MoeTilePolicy tiles;
};

/// The int8 op's config for @p kernel; for nullptr, for qgemm_select(@p cap) (the best kernel
/// this CPU runs, capped by @p cap and CPUMOE_ISA). Never returns a null member.
MoeConfig<QGemmUkernel> int8_config(const QGemmUkernel* kernel, const Isa* cap = nullptr);
/// The bf16 op's config, as int8_config (bgemm_select).
MoeConfig<BGemmUkernel> bf16_config(const BGemmUkernel* kernel, const Isa* cap = nullptr);

/// The W4A8 op's config, as int8_config (q4gemm_select).
MoeConfig<Q4GemmUkernel> w4_config(const Q4GemmUkernel* kernel, const Isa* cap = nullptr);

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

/// Plain 4-bit expert weights (W4A8), in one of two input forms:
///   - int4:  w13 int8 [E, 2I, H] and w2 int8 [E, H, I] holding values in [-8, 7] (one per byte);
///            s13 fp32 [E, 2I, H / g], s2 fp32 [E, H, I / g] group scales, finite and > 0.
///   - mxfp4: gpt-oss's layout: w13 uint8 [E, 2I, H / 32, 16] and w2 [E, H, I / 32, 16], two
///            E2M1 codes per byte, the low nibble first (k even); s13 uint8 [E, 2I, H / 32] and s2
///            [E, H, I / 32] E8M0 scales (255 is NaN: its group's outputs are NaN).
/// g = group_size: as the format's row of the format table says (int4: a multiple of
/// kW4GroupMultiple up to kW4MaxGroup; mxfp4: 32), dividing H and I.
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
};

/// How PackedExperts packs one expert's w13 and w2 for the layer's kernel: the sizes per expert
/// and the packing itself (called once per expert, from several threads). Internal to the
/// packed classes; exposed only because their protected constructor takes one.
struct RhsPacker {
  virtual ~RhsPacker() = default;
  /// ArgumentError for missing weights (called first, once the sizes are checked).
  virtual void check() const = 0;
  virtual size_t w13_bytes() const = 0;
  virtual size_t w2_bytes() const = 0;
  virtual void pack(int64_t e, void* w13_dst, void* w2_dst) const = 0;
};

/// Expert weights packed for one kernel of a family (QGemmUkernel: int8, BGemmUkernel: bf16):
/// the part both packed kinds share. Immutable after construction; safe to share between threads
/// and calls.
template <class Kernel>
class PackedExperts {
 public:
  ~PackedExperts();
  PackedExperts(const PackedExperts&) = delete;
  PackedExperts& operator=(const PackedExperts&) = delete;

  int64_t num_experts() const { return e_; }
  int64_t hidden() const { return h_; }
  int64_t intermediate() const { return i_; }
  bool has_bias13() const { return has_b13_; }
  bool has_bias2() const { return has_b2_; }
  const Kernel& kernel() const { return *config_.gemm; }
  /// The chain chosen at prepack: kernel, row operations, tile policy.
  const MoeConfig<Kernel>& config() const { return config_; }
  /// Bytes held by the packed weights, scales and biases.
  size_t packed_bytes() const;

  // For the dispatcher: expert e's packed w13 / w2 and biases (fp32).
  const void* w13(int64_t e) const;
  const void* w2(int64_t e) const;
  const float* b13(int64_t e) const { return has_b13_ ? b13_.get() + e * 2 * i_ : nullptr; }
  const float* b2(int64_t e) const { return has_b2_ ? b2_.get() + e * h_ : nullptr; }

 protected:
  /// Checks the sizes and the CPU, packs w13 [E, 2I, H] and w2 [E, H, I] (elements of the
  /// kernel's weight type) for config.gemm and converts the biases. Throws ArgumentError.
  template <class Elem>
  PackedExperts(int64_t e, int64_t h, int64_t i, const MoeConfig<Kernel>& config, const Elem* w13,
                const Elem* w2, const void* b13, DType b13_dtype, const void* b2, DType b2_dtype,
                int num_threads);
  /// The same checks, then each expert packed by @p packer (whose functions are called only
  /// after the sizes and the config are checked).
  PackedExperts(int64_t e, int64_t h, int64_t i, const MoeConfig<Kernel>& config,
                const RhsPacker& packer, const void* b13, DType b13_dtype, const void* b2,
                DType b2_dtype, int num_threads);
  size_t extra_bytes_ = 0;  ///< bytes a derived class holds besides the packed weights

 private:
  struct AlignedFree {
    void operator()(void* p) const;
  };
  int64_t e_, h_, i_;
  MoeConfig<Kernel> config_;
  size_t w13_stride_ = 0, w2_stride_ = 0;  // bytes per expert
  std::unique_ptr<uint8_t, AlignedFree> w13_, w2_;
  std::unique_ptr<float[]> b13_, b2_;
  bool has_b13_ = false, has_b2_ = false;
};

/// Int8 expert weights packed for one QGemmUkernel, with their per-output-channel scales.
class PackedMoe : public PackedExperts<QGemmUkernel> {
 public:
  /// Packs @p w for @p kernel (nullptr: qgemm_select() for this CPU, capped by CPUMOE_ISA).
  /// @pre E >= 1; H, I >= kDimMultiple and multiples of it; scales finite and > 0.
  /// Throws ArgumentError otherwise. Threads: up to @p num_threads (<= 0: the OpenMP default).
  PackedMoe(const MoeWeights& w, const QGemmUkernel* kernel = nullptr, int num_threads = 0);
  /// Packs @p w for the chain @p config (from int8_config); as above otherwise.
  PackedMoe(const MoeWeights& w, const MoeConfig<QGemmUkernel>& config, int num_threads = 0);

  /// The row of the format table (weight_format.h) this layer is packed in.
  WeightFormat weight_format() const { return WeightFormat::int8; }
  const float* s13(int64_t e) const { return s13_.get() + e * 2 * intermediate(); }
  const float* s2(int64_t e) const { return s2_.get() + e * hidden(); }

 private:
  std::unique_ptr<float[]> s13_, s2_;
};

/// 4-bit expert weights (W4A8) packed for one Q4GemmUkernel, group scales inside the packed
/// blocks. Run by fused_moe_int8 (the activations are int8 as in W8A8).
class PackedMoeW4 : public PackedExperts<Q4GemmUkernel> {
 public:
  /// Packs @p w for @p kernel (nullptr: q4gemm_select() for this CPU, capped by CPUMOE_ISA).
  /// @pre E >= 1; H, I >= kDimMultiple and multiples of it and of the group size; the group a
  /// multiple of kW4GroupMultiple (mxfp4: exactly 32); int4 values in [-8, 7] and scales
  /// finite and > 0. Throws ArgumentError otherwise, naming the argument.
  PackedMoeW4(const MoeWeightsW4& w, const Q4GemmUkernel* kernel = nullptr, int num_threads = 0);
  /// Packs @p w for the chain @p config (from w4_config); as above otherwise.
  PackedMoeW4(const MoeWeightsW4& w, const MoeConfig<Q4GemmUkernel>& config, int num_threads = 0);
  W4Format format() const { return layout_.format; }
  WeightFormat weight_format() const { return weight_format_of(layout_.format); }
  int64_t group_size() const { return layout_.group; }
  const W4Layout& layout() const { return layout_; }

 private:
  W4Layout layout_;
};

/// Bf16 expert weights packed for one BGemmUkernel.
class PackedMoeBf16 : public PackedExperts<BGemmUkernel> {
 public:
  /// Packs @p w for @p kernel (nullptr: bgemm_select() for this CPU, capped by CPUMOE_ISA).
  /// @pre E >= 1; H, I >= kDimMultiple and multiples of it. Throws ArgumentError otherwise.
  PackedMoeBf16(const MoeWeightsBf16& w, const BGemmUkernel* kernel = nullptr,
                int num_threads = 0);
  /// Packs @p w for the chain @p config (from bf16_config); as above otherwise.
  PackedMoeBf16(const MoeWeightsBf16& w, const MoeConfig<BGemmUkernel>& config,
                int num_threads = 0);
  WeightFormat weight_format() const { return WeightFormat::bf16; }
};

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
/// Bytes of scratch the calling thread holds now (0 before its first call).
size_t thread_scratch_bytes();
/// Frees the calling thread's scratch (the next call allocates it again).
void release_thread_scratch();

/// Dynamic symmetric per-row int8 quantization, as the op does it:
/// s = max(max|x|, kAmaxFloor) / 127, q = round_half_even(x / s) clamped to [-127, 127].
/// Reads @p n elements of type @p dt; writes q[0..n) and returns s.
float quantize_row(const void* x, DType dt, int64_t n, int8_t* q);

}  // namespace cpumoe
