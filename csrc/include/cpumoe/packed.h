/// @file packed.h
/// A layer's expert weights packed once for the kernel of its chain (MoeConfig): PackedMoe
/// (int8), PackedMoeW4 (the q4gemm formats), PackedMoeBf16 (bf16), PackedMoeFp8 (fp8), over the
/// shared PackedExperts.
/// Immutable after construction; safe to share between threads and calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "cpumoe/moe_config.h"
#include "cpumoe/moe_weights.h"
#include "cpumoe/weight_format.h"

namespace cpumoe {

/// How PackedExperts packs one expert's w13 and w2 for the layer's kernel: the sizes per expert
/// and the packing itself (called once per expert, from several threads). Internal to the
/// packed classes; exposed only because their protected constructor takes one.
struct RhsPacker {
  virtual ~RhsPacker() = default;
  /// ArgumentError for missing weights (called first, once the sizes are checked).
  virtual void check() const = 0;
  virtual size_t w13_bytes() const = 0;
  virtual size_t w2_bytes() const = 0;
  /// Bytes of scratch one pack call needs (the largest over w13 and w2), 0 for none: the caller
  /// allocates one block per thread before its parallel loop, so packing never allocates.
  virtual size_t scratch_bytes() const = 0;
  /// Packs expert @p e.
  /// @pre @p scratch holds scratch_bytes() bytes, 64-byte aligned, used by no other call at the
  ///      same time (contents in and out undefined; may be nullptr when that is 0).
  virtual void pack(int64_t e, void* w13_dst, void* w2_dst, void* scratch) const = 0;
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
/// blocks; the affine layers also hold their group offsets (W4Plan::offset), applied by the
/// pipeline through RowOps::add_group_offsets. Run by fused_moe_int8 (the activations are int8
/// as in W8A8).
class PackedMoeW4 : public PackedExperts<Q4GemmUkernel> {
 public:
  /// Packs @p w for @p kernel (nullptr: q4gemm_select() for this CPU, capped by CPUMOE_ISA).
  /// @pre E >= 1; H, I >= kDimMultiple and multiples of it and of the group size; the group as
  /// the format's row allows; the values and scales as weight_format.h says of the format.
  /// Throws ArgumentError otherwise, naming the argument.
  PackedMoeW4(const MoeWeightsW4& w, const Q4GemmUkernel* kernel = nullptr, int num_threads = 0);
  /// Packs @p w for the chain @p config (from w4_config); as above otherwise.
  PackedMoeW4(const MoeWeightsW4& w, const MoeConfig<Q4GemmUkernel>& config, int num_threads = 0);
  /// The layer's format (int4_affine included).
  W4Format format() const { return format_; }
  WeightFormat weight_format() const { return weight_format_of(format_); }
  int64_t group_size() const { return layout_.group; }
  /// The kernel's layout (format plan().kernel).
  const W4Layout& layout() const { return layout_; }
  /// How the layer is packed for its kernel (w4_plan).
  const W4Plan& plan() const { return plan_; }
  /// How the op quantizes this layer's activations (MoeWeightsW4::act_quant).
  ActQuant act_quant() const { return act_quant_; }
  /// The planes of each matrix (W4Plan: 2 for int8_affine on a kernel without codes8, else 1).
  int planes() const { return plan_.planes; }
  /// Bytes from one plane of an expert's packed [n, depth] matrix (w13: n = 2I, depth = H; w2:
  /// n = H, depth = I) to the next.
  size_t plane_bytes(int64_t n, int64_t depth) const;
  /// The affine formats: expert e's group offsets of w13 / w2 in RowOps::add_group_offsets'
  /// panels (group_offset_floats floats per plane, the planes in turn); nullptr for the others,
  /// and for a one-plane layer whose offsets are all zero (GGUF Q8_0's).
  const float* o13(int64_t e) const {
    return offsets_ ? offsets_.get() + size_t(e) * o13_stride_ : nullptr;
  }
  const float* o2(int64_t e) const {
    return offsets_ ? offsets_.get() + size_t(num_experts()) * o13_stride_ +
                          size_t(e) * o2_stride_
                    : nullptr;
  }

 private:
  W4Plan plan_;
  W4Layout layout_;
  W4Format format_;
  ActQuant act_quant_;
  std::unique_ptr<float[]> offsets_;  // [E] w13 panels, then [E] w2 panels
  size_t o13_stride_ = 0, o2_stride_ = 0;
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

/// FP8 expert weights (W8A16) packed for one F8GemmUkernel, the block scales inside the packed
/// blocks. Run by fused_moe_bf16 (the activations are bf16 as in the BF16 op).
class PackedMoeFp8 : public PackedExperts<F8GemmUkernel> {
 public:
  /// Packs @p w for @p kernel (nullptr: f8gemm_select() for this CPU, capped by CPUMOE_ISA).
  /// @pre E >= 1; H, I >= kDimMultiple and multiples of it; block_n >= 1; block_k 0, a multiple
  /// of kF8BlockMultiple, or >= the depth of each matrix it does not divide into such blocks; no
  /// NaN code (0x7F, 0xFF); scales finite and >= 0. Throws ArgumentError otherwise, naming the
  /// argument.
  PackedMoeFp8(const MoeWeightsFp8& w, const F8GemmUkernel* kernel = nullptr, int num_threads = 0);
  /// Packs @p w for the chain @p config (from fp8_config); as above otherwise.
  PackedMoeFp8(const MoeWeightsFp8& w, const MoeConfig<F8GemmUkernel>& config,
               int num_threads = 0);
  WeightFormat weight_format() const { return WeightFormat::fp8; }
  int64_t block_n() const { return layout_.block_n; }
  /// The block's k extent as given (0: the whole depth).
  int64_t block_k() const { return block_k_; }
  /// The kernels' layout (group: block_k, or the largest depth when that is 0).
  const F8Layout& layout() const { return layout_; }
  /// Bits per packed weight code: 8, or 4 when 4-bit codes were given and the kernel keeps
  /// them (F8GemmUkernel::codes4).
  int64_t code_bits() const { return layout_.code_bits; }

 private:
  F8Layout layout_;
  int64_t block_k_ = 0;
};

}  // namespace cpumoe
