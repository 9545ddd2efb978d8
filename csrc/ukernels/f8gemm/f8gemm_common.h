// What every f8gemm (bf16 x E4M3 -> fp32, fp32 block scales) microkernel shares, in plain C++:
// the packed B layout's sizes and offsets (F8Packing), its packer over a kernel's arrangement of
// the codes within a group (pack_rhs_f8), the E4M3 -> fp32 decode table, the scalar epilogue
// steps and make_f8gemm (the interface table). A's layouts are the bgemm family's
// (bgemm/bgemm_common.h: pack_lhs_f32r, pack_lhs_bf16r work on an F8Packing as they are).
// Internal linkage on purpose (see qgemm/qgemm_common.h): every kernel file has its own ISA flags.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpumoe/f8gemm.h"
#include "ukernels/bgemm/bgemm_common.h"  // pack_lhs_f32r, pack_lhs_bf16r (need only P's lhs part)

namespace cpumoe {
namespace {

/// Packed A and B of an f8gemm kernel.
///
/// A: RowLhsPacking's (bgemm_common.h, as BGemmPacking's), rows of kp = round_up(k, Kr) elements
/// of LhsBytes bytes (2: bf16, 4: widened to fp32), zero-padded from k to kp, the row count
/// rounded up to LhsRows with zero rows.
/// Group g of a row starts at element g * group_k (below), as in B.
///
/// B: blocks of Nr output columns, each a multiple of 64 bytes (so every block starts a cache
/// line: rhs_offset(j) is a multiple of 64 for j a multiple of Nr). A block holds the groups of k
/// in order; group g (k in [g * gk, g * gk + len), gk = group_k(k, w), len = gk except for the
/// last group) is
///   - the codes: Nr * gp positions, gp = round_up(len, Kr) (= gk for all but the last group, as
///     kF8GroupMultiple is a multiple of Kr), in the kernel's arrangement (pack_rhs_f8's Arrange),
///     codes past len and columns past n stored as the recoded code 0 (the value +0). A position
///     is a byte for 8-bit codes. For 4-bit codes (kernels with NibbleSpan S > 0), positions
///     [2 S c, 2 S c + S) are the low nibbles of bytes [S c, S c + S) and the next S positions
///     their high nibbles (a vector of S bytes unpacks into two of S codes, each in the order
///     the 8-bit form has them); padding is the codebook's first zero;
///   - zero bytes up to a multiple of 4 (none when Nr * Kr * bits / 8 is a multiple of 4);
///   - the Nr fp32 scales of the group, column c's at 4 c (the kernel's Recode::scale of the
///     block scale of column c: as given unless a kernel folds a power of two in), 0 for columns
///     past n.
/// Groups follow each other at a fixed stride (group_stride): only the last may be shorter. Zero
/// bytes pad the block to a multiple of 64. Offsets at multiples of Nr.
template <int64_t Nr, int64_t Kr, int64_t LhsBytes, int64_t LhsRows = 1, int64_t NibbleSpan = 0>
struct F8Packing : RowLhsPacking<Kr, LhsBytes, LhsRows> {
  static_assert(kF8GroupMultiple % Kr == 0, "every group but the last must be whole k steps");
  static_assert(NibbleSpan == 0 || (Nr * Kr) % (2 * NibbleSpan) == 0,
                "a k step's 4-bit codes fill whole spans");
  static constexpr int64_t kNr = Nr;
  /// 0: 8-bit codes only; else 4-bit codes too, S = NibbleSpan (above).
  static constexpr int64_t kNibbleSpan = NibbleSpan;

  /// k per group (every group but the last): the layout's group, or k when that covers k.
  static int64_t group_k(int64_t k, const F8Layout& w) { return w.group >= k ? k : w.group; }
  /// Real k of group @p g (the last one may be shorter).
  static int64_t group_len(int64_t g, int64_t k, const F8Layout& w) {
    const int64_t gk = group_k(k, w);
    return std::min(gk, k - g * gk);
  }
  /// Padded k of group @p g (group_len rounded up to kr).
  static int64_t group_kp(int64_t g, int64_t k, const F8Layout& w) {
    return round_up(group_len(g, k, w), Kr);
  }
  /// Bytes of a group's codes and the padding after them, for a group of @p gp padded k.
  static int64_t codes_bytes(int64_t gp, const F8Layout& w) {
    return round_up(Nr * gp * w.code_bits / 8, 4);
  }
  /// Bytes from one group of a block to the next.
  static int64_t group_stride(int64_t k, const F8Layout& w) {
    return codes_bytes(round_up(group_k(k, w), Kr), w) + 4 * Nr;
  }
  /// Bytes of a block's groups (before the padding to 64).
  static int64_t groups_bytes(int64_t k, const F8Layout& w) {
    const int64_t groups = f8_groups(k, w);
    const int64_t last = round_up(group_len(groups - 1, k, w), Kr);
    return (groups - 1) * group_stride(k, w) + codes_bytes(last, w) + 4 * Nr;
  }
  static size_t block_bytes(int64_t k, const F8Layout& w) {
    return size_t(round_up(groups_bytes(k, w), 64));
  }
  static size_t rhs_size(int64_t n, int64_t k, const F8Layout& w) {
    return size_t((n + Nr - 1) / Nr) * block_bytes(k, w);
  }
  static size_t rhs_offset(int64_t n_idx, int64_t k, const F8Layout& w) {
    return size_t(n_idx / Nr) * block_bytes(k, w);
  }
};

/// A group's codes as G-k steps of Nr columns: step s holds Nr * G bytes, column c's k = G s ..
/// G s + G - 1 at G c (as gemm_tile's B groups). G = 1 is `f8ck<nr>` (k-major: the Nr codes of
/// one k contiguous); G = 4 is `f8ci<nr>x4` (one 32-bit lane per column). Needs Kr % G == 0.
template <int64_t Nr, int64_t G>
struct F8Interleaved {
  static constexpr int64_t kG = G;
  static int64_t index(int64_t c, int64_t kk, int64_t /*gp*/) {
    return (kk / G) * (Nr * G) + c * G + kk % G;
  }
};

/// The codes and the scales as given (pack_rhs_f8's default Recode). A kernel that stores the
/// codes otherwise (e.g. E4M3 bits moved into fp16 positions, the value times 2^-8) gives its own
/// code(c) (code(0) must still mean +0: it fills the padding) and scale(s) (here s * 2^8).
struct KeepF8 {
  static uint8_t code(uint8_t c) { return c; }
  static float scale(float s) { return s; }
};

/// F8GemmUkernel::pack_rhs for packing P, codes at Arrange::index(c, kk, gp) (0 <= index <
/// Nr * gp, one position each) within each group, each code stored as Recode::code, each scale
/// as Recode::scale; 4-bit codes (w.code_bits 4, P::kNibbleSpan > 0) as they are, in nibbles
/// (F8Packing). Reads each column's k codes and its block row's f8_groups scales, nothing else;
/// writes every byte of rhs_size(n, k, w).
template <class P, class Arrange, class Recode = KeepF8>
void pack_rhs_f8(int64_t n, int64_t k, const F8Layout& w, const uint8_t* codes,
                 int64_t code_stride, const float* scales, int64_t scale_stride, void* packed) {
  constexpr int64_t Nr = P::kNr, S = P::kNibbleSpan;
  if (n <= 0) return;
  const bool nibbles = w.code_bits == 4;
  if (nibbles && (S == 0 || f8_codebook_zero(w) < 0)) return;  // the interface's precondition
  const int64_t groups = f8_groups(k, w), gk = P::group_k(k, w), stride = P::group_stride(k, w);
  const uint8_t zero = nibbles ? uint8_t(f8_codebook_zero(w)) : Recode::code(0);
  auto* dst = static_cast<uint8_t*>(packed);
  for (int64_t j0 = 0; j0 < n; j0 += Nr) {
    uint8_t* blk = dst + P::rhs_offset(j0, k, w);
    const int64_t valid = std::min(Nr, n - j0);
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* grp = blk + g * stride;
      const int64_t len = P::group_len(g, k, w), gp = round_up(len, P::kKr);
      const int64_t cb = P::codes_bytes(gp, w), used = nibbles ? Nr * gp / 2 : Nr * gp;
      // Padding k and padding columns: the zero code; then each real code at its place.
      std::memset(grp, nibbles ? zero | zero << 4 : zero, size_t(used));
      std::memset(grp + used, 0, size_t(cb - used));
      for (int64_t c = 0; c < valid; ++c) {
        const uint8_t* col = codes + (j0 + c) * code_stride + g * gk;
        for (int64_t kk = 0; kk < len; ++kk) {
          const int64_t p = Arrange::index(c, kk, gp);
          if (!nibbles) {
            grp[p] = Recode::code(col[kk]);
            continue;
          }
          const int64_t r = p % (2 * S), byte = p / (2 * S) * S + r % S, shift = r < S ? 0 : 4;
          grp[byte] = uint8_t((grp[byte] & ~(15 << shift)) | (col[kk] & 15) << shift);
        }
      }
      float s[Nr];
      for (int64_t c = 0; c < Nr; ++c)
        s[c] = c < valid ? Recode::scale(scales[((j0 + c) / w.block_n) * scale_stride + g]) : 0.0f;
      std::memcpy(grp + cb, s, sizeof(s));
    }
    const size_t used = size_t(P::groups_bytes(k, w));
    std::memset(blk + used, 0, P::block_bytes(k, w) - used);
  }
}

/// The fp32 values of the 256 E4M3 codes (e4m3_value as a table; NaN for 0x7F and 0xFF, which
/// never reach a kernel). Built at compile time, so every kernel file holds its own copy (no
/// shared symbol).
struct E4m3Table {
  float v[256];
};
constexpr E4m3Table make_e4m3_table() {
  E4m3Table t{};
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 3) & 15, m = c & 7;
    float v = 0.0f;
    if ((c & 0x7F) == 0x7F) {
      v = std::numeric_limits<float>::quiet_NaN();
    } else if (e == 0) {
      v = float(m) / 512.0f;  // m / 8 * 2^-6
    } else {
      v = 1.0f + float(m) / 8.0f;  // (1 + m / 8) * 2^(e - 7), the power by exact doubling
      for (int x = 7; x < e; ++x) v *= 2.0f;
      for (int x = e; x < 7; ++x) v /= 2.0f;
    }
    t.v[c] = (c & 0x80) ? -v : v;
  }
  return t;
}
constexpr E4m3Table kE4m3Table = make_e4m3_table();

/// The values of @p w's 16 codebook entries times @p factor (a power of two: exact), for a
/// kernel's 4-bit decode table.
inline void f8_codebook_values(const F8Layout& w, float factor, float* out) {
  for (int i = 0; i < 16; ++i) out[i] = kE4m3Table.v[w.codebook[size_t(i)]] * factor;
}

/// dst[j] = acc[j] (+ bias[j]) for j < n: the scalar final step of every kernel.
inline void store_f8_row(float* dst, const float* acc, int64_t n, const float* bias) {
  if (bias != nullptr) {
    for (int64_t j = 0; j < n; ++j) dst[j] = acc[j] + bias[j];
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = acc[j];
  }
}

/// The layout numbers of one call that a kernel's tiles share (packing P, depth k, layout w):
/// k, kp = P::padded_k(k), the group count, group_k, group_stride and block_bytes.
struct F8Call {
  int64_t k, kp, groups, gk, gstride, block_bytes;
  const F8Layout* w;
};
template <class P>
F8Call f8_call(int64_t k, const F8Layout& w) {
  return F8Call{k,
                P::padded_k(k),
                f8_groups(k, w),
                P::group_k(k, w),
                P::group_stride(k, w),
                int64_t(P::block_bytes(k, w)),
                &w};
}

/// F8GemmUkernel::scratch_bytes of a kernel that needs no scratch.
inline size_t f8_no_scratch(int64_t, int64_t, int64_t, const F8Layout&) { return 0; }

/// The interface table of an f8gemm kernel with packing P (an F8Packing, or any class with its
/// members kNr, kKr, kNibbleSpan, lhs_size, lhs_offset, rhs_size, rhs_offset); the kernel takes
/// 4-bit codes when P has a nibble span.
template <class P>
constexpr F8GemmUkernel make_f8gemm(const char* name, Isa isa, int64_t mr,
                                    decltype(F8GemmUkernel::pack_lhs) pack_lhs,
                                    decltype(F8GemmUkernel::pack_rhs) pack_rhs,
                                    decltype(F8GemmUkernel::run_f32) run_f32,
                                    decltype(F8GemmUkernel::scratch_bytes) scratch_bytes =
                                        f8_no_scratch) {
  static_assert(kF8GroupMultiple % P::kKr == 0, "kr must divide kF8GroupMultiple");
  return F8GemmUkernel{name,          isa,         mr,
                       P::kNr,        P::kKr,      P::kNibbleSpan > 0,
                       P::lhs_size,   P::lhs_offset, pack_lhs,
                       P::rhs_size,   P::rhs_offset, pack_rhs,
                       scratch_bytes, run_f32};
}

}  // namespace
}  // namespace cpumoe
