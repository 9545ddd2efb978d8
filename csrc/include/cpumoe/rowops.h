/// @file rowops.h
/// The row-operation family: the per-row work of the MoE pipeline around the GEMMs (quantizing x,
/// the fused activation + dtype rounding + requantization, the bf16 op's conversions, the
/// weighted combine), as one interface struct that every ISA variant fills in, and a registry.
///
/// Every variant gives the bits of the scalar definitions in csrc/ukernels/rowops/quantize.h (and,
/// for the activations, of the per-element vec:: forms of cpumoe/activation.h), for every length, dtype
/// and special value: which variant ran never changes a result. The dispatcher takes the variant
/// that goes with the GEMM kernel of the packed weights (rowops_for()), so a cap on the kernel
/// (`isa=`, CPUMOE_ISA) caps the row operations too.
///
/// Variants (file name == variant name, in csrc/ukernels/rowops/{portable,arm,x86}):
///  - rowops_portable: the baseline build: quantize.h's scalar definitions on x86-64, the NEON
///    backend (Armv8.0 Advanced SIMD, 4 lanes) on AArch64.
///  - rowops_avx512: AVX-512 F/BW/VL, 16 lanes, masked tails (level avx512_vnni, whose CPUs all
///    have those).
///  - rowops_avx2: AVX2 + F16C, 8 lanes (level avx2).
///  - rowops_neon_bf16: rowops_portable's NEON with the bf16 rounding by BFCVTN (level neon_bf16,
///    so also with the I8MM kernel on CPUs that have both).
/// The vector variants share one algorithm (csrc/ukernels/rowops/rowops_vec.h) and differ only in
/// the vector backend.
#pragma once

#include <cstdint>
#include <vector>

#include "cpumoe/activation.h"
#include "cpumoe/cpu_features.h"
#include "cpumoe/dtype.h"

namespace cpumoe {

/// Floor of a token's (or activation row's) absolute maximum before dividing by 127, so an
/// all-zero row gets a finite scale and quantizes to zeros.
constexpr float kAmaxFloor = 1e-7f;

/// One row-operation variant. Rows are contiguous; n, inter >= 0; every pointer valid for the
/// elements it covers. Outputs never overlap inputs.
struct RowOps {
  const char* name;
  Isa isa;  ///< the ISA level it needs at run time

  /// Dynamic symmetric int8 quantization of x[0..n) of type dt: s = max(max|x|, kAmaxFloor) / 127,
  /// q = round_half_even(x / s) clamped to [-127, 127] (NaN -> 0); returns s (NaN if any x is).
  float (*quantize)(const void* x, DType dt, int64_t n, int8_t* q);

  /// The W8A8 op's step 5, first half, for one GEMM1 row of 2 * inter values:
  /// a[0..inter) = round_to_dtype(act(gate, up)) (gate_up_layout); returns max |a| (a NaN if any
  /// a is NaN), for quantize_with_amax.
  float (*activate_round)(const ActivationSpec& act, const float* row, int64_t inter, DType dt,
                          float* a);

  /// quantize(a, DType::f32, n, q) for a row whose max |a| the caller already has.
  float (*quantize_with_amax)(const float* a, int64_t n, float amax, int8_t* q);

  /// The bf16 op's step 5: out = f32_to_bf16(act(gate, up)), inter values.
  void (*activate_bf16)(const ActivationSpec& act, const float* row, int64_t inter, uint16_t* out);

  /// out[i] = f32_to_bf16(x[i]) for x of type dt (the bf16 op's input rounding).
  void (*to_bf16)(const void* x, DType dt, int64_t n, uint16_t* out);

  /// One pass of the weighted combine over nj (1..8) slots: a[i] = (first ? 0 : acc[i]) +
  /// ws[0] * ys[0][i] + ... in that order (fp32, no FMA); last: a goes to dst in dtype dt,
  /// else to acc.
  void (*weighted_sum_pass)(int nj, const float* const* ys, const float* ws, int64_t n,
                            bool first, bool last, DType dt, void* dst, float* acc);

  /// out[g] = float(sum of q[g * group .. (g + 1) * group)) for g < depth / group: exact int32
  /// sums, exact in fp32 too (|sum| <= 127 * group < 2^24). For add_group_offsets.
  /// @pre group >= 1 divides depth; group <= 65536.
  void (*group_sums)(const int8_t* q, int64_t depth, int64_t group, float* out);

  /// The group-offset term of a GEMM on affine weights (int4_affine: w = s * (code - 8) + o per
  /// group), after the kernel: for i < m, j < n,
  ///   dst[i * dst_stride + j] += (sum_g sums[i * groups + g] * off(g, n0 + j)) * row_scale[i]
  /// (fp32: the sum from 0.0f, g increasing, each product and sum rounded, no FMA), sums from
  /// group_sums of row i, off(g, j) = offsets[(j / P) * groups * P + g * P + j % P] with
  /// P = kGroupOffsetPanel (offsets at the matrix's column 0).
  void (*add_group_offsets)(int64_t m, int64_t n0, int64_t n, int64_t groups, const float* sums,
                            const float* offsets, const float* row_scale, float* dst,
                            int64_t dst_stride);
};

/// Columns of one panel of group offsets (RowOps::add_group_offsets).
constexpr int64_t kGroupOffsetPanel = 64;
/// Floats of one [n, depth] matrix's group offsets: whole panels of depth / group rows.
constexpr int64_t group_offset_floats(int64_t n, int64_t depth, int64_t group) {
  return (n + kGroupOffsetPanel - 1) / kGroupOffsetPanel * kGroupOffsetPanel * (depth / group);
}

/// Every variant compiled into this build, best first; rowops_portable is always last.
const std::vector<const RowOps*>& rowops_registry();

/// The best variant this CPU runs whose level is at most @p kernel_isa on this architecture's
/// ladder (the row operations that go with a kernel of that level). Never returns nullptr.
const RowOps* rowops_for(Isa kernel_isa);

/// The variant named @p name (nullptr if not compiled in).
const RowOps* rowops_find(const char* name);

}  // namespace cpumoe
