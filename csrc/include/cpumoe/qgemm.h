/// @file qgemm.h
/// The int8 x int8 -> int32 GEMM microkernel family: one interface struct that every ISA variant
/// fills in, and the registry that lists the variants best first.
///
/// A kernel computes C[m][n] = sum_k A[m][k] * B[n][k] (A: quantized activations, rows gathered
/// per expert; B: one expert's weight matrix [N][K], row-major, as stored in checkpoints), with
/// exact int32 accumulation over the whole K, and stores the dequantized fp32 value
/// acc * lhs_scale[m] * rhs_scale[n] + bias[n].
///
/// Kernel names (qgemm_<lhs>_<rhs>_<mr>x<nr>_<isa>, file name == kernel name) follow the grammar
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

/// Dequantization applied to each accumulator by QGemmUkernel::run_f32.
struct QGemmEpilogue {
  const float* lhs_scale;  ///< [m]: per-row (per-token) scale, indexed from the first row of the call
  const float* rhs_scale;  ///< [n]: per-output-channel scale, indexed from the first column of the call
  const float* bias;       ///< [n] or nullptr
  /// A hint: dst is large and not read again soon, so a kernel may write it past the caches
  /// (non-temporal stores: no read-for-ownership of the lines, no eviction of the weights). The
  /// values written are the same either way.
  bool stream_dst = false;
};

/// One microkernel variant. All sizes are in elements; all pointers must be non-null where the
/// corresponding size is non-zero. Packed buffers are allocated 64-byte aligned by the callers;
/// kernels use unaligned loads, so an offset from the *_offset functions needs no alignment.
struct QGemmUkernel {
  const char* name;  ///< the kernel's name in the grammar above
  Isa isa;           ///< the ISA level it needs at run time
  int64_t mr;        ///< rows of the main register tile; lhs offsets are taken at multiples of it
  int64_t nr;        ///< columns of a packed B block; rhs offsets are taken at multiples of it
  int64_t kr;        ///< K is padded to a multiple of this

  /// Bytes of packed A for @p m rows of depth @p k.
  size_t (*lhs_packed_size)(int64_t m, int64_t k);
  /// Byte offset of row @p m_idx (a multiple of mr) in packed A of depth @p k.
  size_t (*lhs_packed_offset)(int64_t m_idx, int64_t k);
  /// Packs @p m rows of depth @p k; row i is read from rows[i][0..k). Packing rows [m0, m0 + m)
  /// (m0 a multiple of mr) at lhs_packed_offset(m0, k) writes what packing all rows at once
  /// writes there, so row chunks may be packed by different tasks.
  void (*pack_lhs)(int64_t m, int64_t k, const int8_t* const* rows, void* lhs_packed);

  /// Bytes of packed B for @p n output columns of depth @p k.
  size_t (*rhs_packed_size)(int64_t n, int64_t k);
  /// Byte offset of output column @p n_idx (a multiple of nr) in packed B of depth @p k.
  size_t (*rhs_packed_offset)(int64_t n_idx, int64_t k);
  /// Packs B [n][k] whose row j starts at rhs + j * rhs_stride.
  void (*pack_rhs)(int64_t n, int64_t k, const int8_t* rhs, int64_t rhs_stride, void* rhs_packed);

  /// dst[i * dst_stride + j] = float(C[i][j]) * lhs_scale[i] * rhs_scale[j] + bias[j] for
  /// i < m, j < n, in that order in fp32, C the exact int32 sum; nothing else of dst is written.
  /// @p lhs_packed / @p rhs_packed point at row 0 / column 0 of the call (use the offsets).
  void (*run_f32)(int64_t m, int64_t n, int64_t k, const void* lhs_packed, const void* rhs_packed,
                  float* dst, int64_t dst_stride, const QGemmEpilogue& ep);
};

/// Every variant compiled into this build, best first; the portable one is always last.
const std::vector<const QGemmUkernel*>& qgemm_registry();

/// The best variant this CPU runs whose level is at most @p cap (nullptr: no cap beyond
/// CPUMOE_ISA). CPUMOE_ISA, when set, caps further. Never returns nullptr.
const QGemmUkernel* qgemm_select(const Isa* cap = nullptr);

/// The variant named @p name (nullptr if not compiled in).
const QGemmUkernel* qgemm_find(const char* name);

/// Rounds @p v up to a multiple of @p m (m > 0). Always inlined: ISA-flagged objects call it, and
/// an unoptimized (sanitizer) build would otherwise emit a weak copy the linker might keep.
[[gnu::always_inline]] inline constexpr int64_t round_up(int64_t v, int64_t m) {
  return (v + m - 1) / m * m;
}

}  // namespace cpumoe
