// q4gemm_qs8r_q4c4_1x4_portable: the W4A8 GEMM for any CPU, in plain C++.
//
// A is packed as `qs8r` rows (k is a multiple of 32: no padding); B in blocks of 4 columns, each
// group's codes column by column (column c's g codes at c * g, two per byte, low nibble first).
// Per block, row chunk and group, the 4 x g codes are decoded once through the format's table
// into int8, then each row's 4 dot products run over plain int8 (vectorized at the baseline ISA,
// as in the int8 portable kernel) and are scaled into fp32 accumulators; the decoded group lives
// in the call's scratch (4 g bytes: scratch_bytes). int8_affine's 8-bit codes are stored as the
// int8 values c - 128, column by column, and run as they are. Features used: none.
#include <algorithm>
#include <cstring>

#include "cpumoe/q4gemm.h"
#include "ukernels/q4gemm/q4gemm_common.h"

namespace cpumoe {
namespace {

constexpr int64_t kMr = 1;
constexpr int64_t kNr = 4;
constexpr int64_t kRowChunk = 64;  // fp32 accumulators of 64 rows x 4 columns stay on the stack
struct ColumnMajor {
  static int64_t index(int64_t c, int64_t kk, int64_t g) { return c * g + kk; }
};
// 8-bit codes: column by column, as the int8 values c - 128.
struct SignedColumns : ColumnMajor {
  static uint8_t code(uint8_t c) { return uint8_t(c ^ 0x80); }
};
using LhsPacking = QGemmPacking<kNr, 32>;
using Packing = Q4Packing<kNr, 1, SignedColumns>;

inline int32_t dot(const int8_t* __restrict a, const int8_t* __restrict b, int64_t g) {
  int32_t s = 0;
  for (int64_t x = 0; x < g; ++x) s += int32_t(a[x]) * b[x];
  return s;
}

size_t scratch_bytes(int64_t m, int64_t n, int64_t /*k*/, const W4Layout& w) {
  return m > 0 && n > 0 ? size_t(kNr * w.group) : 0;
}

void run_f32(int64_t m, int64_t n, int64_t k, const W4Layout& w, const void* lhs, const void* rhs,
             float* dst, int64_t dst_stride, const Q4GemmEpilogue& ep) {
  const int64_t g = w.group, groups = k / g;
  const bool bytes = w.format == W4Format::int8_affine;
  const int8_t* table = w4_decode_table(w.format);
  const auto* a = static_cast<const int8_t*>(lhs);
  const auto* b = static_cast<const uint8_t*>(rhs);
  int8_t* const vals = static_cast<int8_t*>(ep.scratch);  // one group of a block, decoded
  for (int64_t j0 = 0; j0 < n; j0 += kNr) {
    const int64_t nc = std::min(kNr, n - j0);
    const uint8_t* blk = b + Packing::rhs_offset(j0, k, w);
    for (int64_t i0 = 0; i0 < m; i0 += kRowChunk) {
      const int64_t mc = std::min(kRowChunk, m - i0);
      float acc[kRowChunk][kNr] = {};
      for (int64_t gi = 0; gi < groups; ++gi) {
        const uint8_t* grp = blk + gi * Packing::group_bytes(w);
        const int8_t* v = bytes ? reinterpret_cast<const int8_t*>(grp) : vals;
        for (int64_t x = 0; !bytes && x < kNr * g / 2; ++x) {
          vals[2 * x] = table[grp[x] & 15];
          vals[2 * x + 1] = table[grp[x] >> 4];
        }
        float s[kNr];
        for (int64_t c = 0; c < kNr; ++c)
          s[c] = group_scale(grp + Packing::codes_bytes(w), c, w.format);
        const float* gs = ep.lhs_group_scale;
        for (int64_t i = 0; i < mc; ++i) {
          const int8_t* ar = a + (i0 + i) * k + gi * g;
          for (int64_t c = 0; c < kNr; ++c) {
            const float term = float(dot(ar, v + c * g, g)) * s[c];
            acc[i][c] = acc[i][c] + (gs ? term * gs[(i0 + i) * groups + gi] : term);
          }
        }
      }
      for (int64_t i = 0; i < mc; ++i)
        store_q4_row(dst + (i0 + i) * dst_stride + j0, acc[i], nc, ep.lhs_scale[i0 + i],
                     ep.bias ? ep.bias + j0 : nullptr);
    }
  }
}

}  // namespace

extern const Q4GemmUkernel q4gemm_qs8r_q4c4_1x4_portable = make_q4gemm<LhsPacking, Packing>(
    "q4gemm_qs8r_q4c4_1x4_portable", Isa::portable, kMr, pack_lhs_qs8r<LhsPacking>,
    pack_rhs_q4<Packing, ColumnMajor>, run_f32, scratch_bytes);

}  // namespace cpumoe
