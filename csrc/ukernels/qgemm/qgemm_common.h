// What every qgemm (int8 x int8 -> int32) microkernel shares, in plain C++: the packed sizes and
// offsets (QGemmPacking), the `qs8r` packer, the scalar tail store and make_qgemm (the interface
// table, common/ukernel_table.h). All kernels apply the epilogue in one order,
// (acc * lhs_scale) * rhs_scale + bias, so their fp32 results agree bit for bit (the build
// disables FMA contraction for the same reason).
// Internal linkage on purpose: every kernel file is built with its own ISA flags, and one shared
// inline copy (a weak symbol) could be taken by the linker from a file built for AVX-512 or I8MM
// and then run, from the portable kernel, on a CPU without them.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpumoe/qgemm.h"
#include "ukernels/common/ukernel_table.h"

namespace cpumoe {
namespace {

/// A kernel's packing: K padded to kp = round_up(k, Kr); A rows of kp elements of LhsBytes bytes,
/// the row count rounded up to LhsRows (row blocks padded with zero rows); B in blocks of Nr
/// columns, each block Nr * kp elements of RhsBytes bytes followed by RhsExtra bytes (e.g. the
/// column sums of a `...s` layout). Offsets are taken at multiples of mr / Nr.
template <int64_t Nr, int64_t Kr, int64_t LhsBytes = 1, int64_t LhsRows = 1, int64_t RhsBytes = 1,
          int64_t RhsExtra = 0>
struct QGemmPacking {
  static constexpr int64_t kNr = Nr, kKr = Kr;
  static int64_t padded_k(int64_t k) { return round_up(k, Kr); }
  static size_t lhs_size(int64_t m, int64_t k) {
    return size_t(round_up(m, LhsRows)) * size_t(padded_k(k)) * size_t(LhsBytes);
  }
  static size_t lhs_offset(int64_t m_idx, int64_t k) {
    return size_t(m_idx) * size_t(padded_k(k)) * size_t(LhsBytes);
  }
  static size_t rhs_block_bytes(int64_t k) {
    return size_t(Nr * padded_k(k) * RhsBytes + RhsExtra);
  }
  static size_t rhs_size(int64_t n, int64_t k) {
    return size_t((n + Nr - 1) / Nr) * rhs_block_bytes(k);
  }
  static size_t rhs_offset(int64_t n_idx, int64_t k) {
    return size_t(n_idx / Nr) * rhs_block_bytes(k);
  }
};

/// The `qs8r` lhs layout: row i at i * kp bytes, zero-padded from k to kp.
inline void pack_lhs_qs8r(int64_t m, int64_t k, int64_t kp, const int8_t* const* rows,
                          int8_t* dst) {
  for (int64_t i = 0; i < m; ++i) {
    std::memcpy(dst + i * kp, rows[i], size_t(k));
    std::memset(dst + i * kp + k, 0, size_t(kp - k));
  }
}

/// QGemmUkernel::pack_lhs for the `qs8r` layout of packing P.
template <class P>
void pack_lhs_qs8r(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  pack_lhs_qs8r(m, k, P::padded_k(k), rows, static_cast<int8_t*>(packed));
}

inline void store_f32_row(float* dst, const int32_t* acc, int64_t n, float lhs_scale,
                          const float* rhs_scale, const float* bias) {
  if (bias != nullptr) {
    for (int64_t j = 0; j < n; ++j) dst[j] = float(acc[j]) * lhs_scale * rhs_scale[j] + bias[j];
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = float(acc[j]) * lhs_scale * rhs_scale[j];
  }
}

/// The interface table of a qgemm kernel with packing P.
template <class P>
constexpr auto make_qgemm = make_ukernel<QGemmUkernel, P>;

}  // namespace
}  // namespace cpumoe
