/// @file bgemm.h
/// The bf16 x bf16 -> fp32 GEMM microkernel family (the BF16 MoE op's kernels): one interface
/// struct that every ISA variant fills in, and the registry that lists the variants best first.
///
/// A kernel computes C[m][n] = sum_k A[m][k] * B[n][k] + bias[n] in fp32, A and B bf16 (raw
/// uint16_t bit patterns). Each product of two bf16 values is exact in fp32; the sums are fp32
/// in an order of the kernel's own (fixed for a given kernel and shape, so a kernel is
/// deterministic, but two kernels may differ in the last bits). Subnormal bf16 inputs may be
/// treated as zero by the hardware paths (BFMMLA, VDPBF16PS do so).
///
/// Kernel names (bgemm_<lhs>_<rhs>_<mr>x<nr>_<isa>, file name == kernel name) follow the grammar
/// in csrc/ukernels/README.md.
///
/// Packing pads K up to a multiple of kr and N up to a multiple of nr with zeros, so a kernel is
/// correct for every m >= 0, n >= 0, k >= 1; callers never pad themselves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpumoe/cpu_features.h"

namespace cpumoe {

/// One bf16 microkernel variant. Sizes in elements; pointers non-null where the corresponding
/// size is non-zero; packed buffers 64-byte aligned by the callers (kernels load unaligned).
struct BGemmUkernel {
  const char* name;  ///< the kernel's name in the grammar above
  Isa isa;           ///< the ISA level it needs at run time
  int64_t mr;        ///< rows of the main register tile; lhs offsets are taken at multiples of it
  int64_t nr;        ///< columns of a packed B block; rhs offsets are taken at multiples of it
  int64_t kr;        ///< K is padded to a multiple of this

  /// Bytes of packed A for @p m rows of depth @p k.
  size_t (*lhs_packed_size)(int64_t m, int64_t k);
  /// Byte offset of row @p m_idx (a multiple of mr) in packed A of depth @p k.
  size_t (*lhs_packed_offset)(int64_t m_idx, int64_t k);
  /// Packs @p m rows of depth @p k; row i is read from rows[i][0..k) (bf16 bits). Packing rows
  /// [m0, m0 + m) (m0 a multiple of mr) at lhs_packed_offset(m0, k) writes what packing all rows
  /// at once writes there, so row chunks may be packed by different tasks.
  void (*pack_lhs)(int64_t m, int64_t k, const uint16_t* const* rows, void* lhs_packed);

  /// Bytes of packed B for @p n output columns of depth @p k.
  size_t (*rhs_packed_size)(int64_t n, int64_t k);
  /// Byte offset of output column @p n_idx (a multiple of nr) in packed B of depth @p k; a
  /// multiple of 64 bytes.
  size_t (*rhs_packed_offset)(int64_t n_idx, int64_t k);
  /// Packs B [n][k] (bf16 bits) whose row j starts at rhs + j * rhs_stride.
  void (*pack_rhs)(int64_t n, int64_t k, const uint16_t* rhs, int64_t rhs_stride,
                   void* rhs_packed);

  /// dst[i * dst_stride + j] = C[i][j] (+ bias[j] when @p bias is not null), fp32.
  /// @p lhs_packed / @p rhs_packed point at row 0 / column 0 of the call (use the offsets).
  void (*run_f32)(int64_t m, int64_t n, int64_t k, const void* lhs_packed, const void* rhs_packed,
                  float* dst, int64_t dst_stride, const float* bias);
};

/// Every bf16 variant compiled into this build, best first; the portable one is always last.
const std::vector<const BGemmUkernel*>& bgemm_registry();

/// The best bf16 variant this CPU runs whose level is at most @p cap (nullptr: no cap beyond
/// CPUMOE_ISA). CPUMOE_ISA, when set, caps further. Never returns nullptr.
const BGemmUkernel* bgemm_select(const Isa* cap = nullptr);

/// The bf16 variant named @p name (nullptr if not compiled in).
const BGemmUkernel* bgemm_find(const char* name);

}  // namespace cpumoe
