// What the bgemm (bf16 x bf16 -> fp32) microkernels share, in plain C++: the packed sizes, the
// packers of the layouts named in bgemm.h, the call of gemm_tile.h's walk and the assembly of a
// kernel's interface table.
// Internal linkage on purpose: each kernel file is built with its own ISA flags (see
// qgemm_common.h).
#pragma once

#include <cstdint>

#include "cpumoe/bgemm.h"
#include "cpumoe/dtype.h"
#include "cpumoe/qgemm.h"
#include "ukernels/common/gemm_tile.h"
#include "ukernels/common/ukernel_table.h"

namespace cpumoe {
namespace {

/// The A part of a kernel's packing (BGemmPacking's, F8Packing's): K padded to
/// kp = round_up(k, Kr); A rows of kp elements of LhsBytes bytes (2: bf16, 4: widened to fp32),
/// the row count rounded up to LhsRows (zero rows).
template <int64_t Kr, int64_t LhsBytes, int64_t LhsRows>
struct RowLhsPacking {
  static constexpr int64_t kKr = Kr, kLhsBytes = LhsBytes, kLhsRows = LhsRows;
  static int64_t padded_k(int64_t k) { return round_up(k, Kr); }
  static size_t lhs_size(int64_t m, int64_t k) {
    return size_t(round_up(m, LhsRows)) * size_t(padded_k(k)) * size_t(LhsBytes);
  }
  static size_t lhs_offset(int64_t m_idx, int64_t k) {
    return size_t(m_idx) * size_t(padded_k(k)) * size_t(LhsBytes);
  }
};

/// A kernel's packing: A as RowLhsPacking's; B in blocks of Nr columns x kp bf16 (a multiple of
/// 64 bytes when Nr * Kr is a multiple of 32).
template <int64_t Nr, int64_t Kr, int64_t LhsBytes, int64_t LhsRows = 1>
struct BGemmPacking : RowLhsPacking<Kr, LhsBytes, LhsRows> {
  static_assert(Nr * Kr % 32 == 0, "packed B blocks must be multiples of 64 bytes");
  static constexpr int64_t kNr = Nr;
  using RowLhsPacking<Kr, LhsBytes, LhsRows>::padded_k;
  static size_t rhs_size(int64_t n, int64_t k) {
    return size_t(round_up(n, Nr)) * size_t(padded_k(k)) * 2;
  }
  static size_t rhs_offset(int64_t n_idx, int64_t k) {
    return size_t(n_idx / Nr * Nr) * size_t(padded_k(k)) * 2;
  }
};

/// Row i of A at i * kp elements of T, each cvt(the bf16 bits), zero-padded from k to kp; the
/// padding rows up to a multiple of LhsRows are zero.
template <class P, class T, class Cvt>
void pack_lhs_rows(int64_t m, int64_t k, const uint16_t* const* rows, void* packed, Cvt cvt) {
  static_assert(sizeof(T) == P::kLhsBytes, "the packing's A element");
  const int64_t kp = P::padded_k(k);
  auto* dst = static_cast<T*>(packed);
  for (int64_t i = 0; i < m; ++i) {
    T* d = dst + i * kp;
    for (int64_t x = 0; x < k; ++x) d[x] = cvt(rows[i][x]);
    for (int64_t x = k; x < kp; ++x) d[x] = T(0);
  }
  for (int64_t x = m * kp; x < round_up(m, P::kLhsRows) * kp; ++x) dst[x] = T(0);
}

/// The `f32r` lhs layout: row i at i * kp floats, bf16 widened to fp32 (exact).
template <class P>
void pack_lhs_f32r(int64_t m, int64_t k, const uint16_t* const* rows, void* packed) {
  // A lambda, not &bf16_to_f32: a function whose address is taken gets an out-of-line copy, and
  // one built with this file's ISA flags must not become the library's (IsaObjects test).
  pack_lhs_rows<P, float>(m, k, rows, packed, [](uint16_t h) { return bf16_to_f32(h); });
}

/// The `bf16r` lhs layout: row i at i * kp bf16.
template <class P>
void pack_lhs_bf16r(int64_t m, int64_t k, const uint16_t* const* rows, void* packed) {
  pack_lhs_rows<P, uint16_t>(m, k, rows, packed, [](uint16_t h) { return h; });
}

/// The bf16 rhs layouts of gemm_tile.h, block b of nr columns at b * nr * kp bf16 in k groups of
/// G: G = 1 is `bf16ck<nr>` (k-major: the nr values of step x at x * nr), G = 2 is
/// `bf16ci<nr>x2` (kp / 2 groups of 2 * nr values, column c's k = 2g, 2g+1 at 2c, 2c+1: one
/// 32-bit lane per column).
template <class P, int G>
void pack_rhs_bf16c(int64_t n, int64_t k, const uint16_t* rhs, int64_t stride, void* packed) {
  const int64_t kp = P::padded_k(k);
  gemm_tile::pack_rhs_groups<uint16_t, G>(n, k, kp, P::kNr, rhs, stride,
                                          static_cast<uint16_t*>(packed), P::kNr * kp);
}

/// BGemmUkernel::run_f32 as gemm_tile.h's walk over operands packed by P, in Ops's k groups of
/// kBGroupBytes / (2 kNr) k; Store{dst, dst_stride, bias} stores the rows.
template <class Ops, class P, class Store>
void run_f32_tiles(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
                   int64_t dst_stride, const float* bias) {
  static_assert(Ops::kNr == P::kNr, "one packed block is one tile block");
  constexpr int64_t group_k = Ops::kBGroupBytes / (2 * P::kNr);
  static_assert(group_k >= 1 && P::kKr % group_k == 0, "whole groups in the padded depth");
  const int64_t kp = P::padded_k(k);
  gemm_tile::run<Ops>(m, n, static_cast<const uint8_t*>(lhs), P::kLhsBytes * kp,
                      static_cast<const uint8_t*>(rhs), 2 * P::kNr * kp, kp / group_k,
                      Store{dst, dst_stride, bias});
}

/// The interface table of a bgemm kernel with packing P.
template <class P>
constexpr auto make_bgemm = make_ukernel<BGemmUkernel, P>;

}  // namespace
}  // namespace cpumoe
