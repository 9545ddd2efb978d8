// What every q4gemm (int8 x 4-bit -> fp32, group scales) microkernel shares, in plain C++: the
// packed B layout's sizes and offsets (Q4Packing), its packer over a kernel's nibble arrangement,
// the scalar group-scale and store steps, and make_q4gemm (the interface table). A's layouts are
// the qgemm family's (qgemm/qgemm_common.h); what only the x86 kernels share is in
// x86/q4gemm_x86_common.h, the AArch64 ones' in arm/q4gemm_arm_common.h.
// Internal linkage on purpose (see qgemm/qgemm_common.h): every kernel file has its own ISA flags.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpumoe/q4gemm.h"
#include "ukernels/qgemm/qgemm_common.h"

namespace cpumoe {
namespace {

/// No 8-bit codes: Q4Packing's Bytes of a kernel without Q4GemmUkernel::codes8.
struct NoBytes {};

/// Packed B of a q4gemm kernel: blocks of Nr output columns; a block holds, for each group g of
/// k in order, the group's codes (Nr * group / 2 bytes, two codes per byte, low nibble first, in
/// the kernel's arrangement; int8_affine: Nr * group bytes, one code per byte, arranged by
/// Bytes::index(c, kk, g) and stored as Bytes::code(c), when Bytes is not NoBytes) followed by
/// the Nr columns' scales of that group (fp32 for int4 and int8_affine as given to pack_rhs;
/// mxfp4: the E8M0 bytes as given when MxScaleBytes is 1, else the fp32 w4_mxfp4_scale (4) or
/// its high half, the bf16 of the same value (2: exact, as the value is a power of two or NaN)),
/// padded to a multiple of 4 bytes; the block is padded to a multiple of 64 bytes (each block
/// starts a cache line). Columns past n have the value 0 (code 0 of the 4-bit formats,
/// Bytes::code(128) of the 8-bit ones) and scale bytes 0. Offsets at multiples of Nr.
template <int64_t Nr, int64_t MxScaleBytes = 1, class Bytes = NoBytes>
struct Q4Packing {
  static_assert(MxScaleBytes == 1 || MxScaleBytes == 2 || MxScaleBytes == 4, "E8M0, bf16, fp32");
  static constexpr int64_t kNr = Nr;
  static constexpr int64_t kMxScaleBytes = MxScaleBytes;
  using ByteArrangement = Bytes;
  static constexpr bool kCodes8 = !std::is_same_v<Bytes, NoBytes>;
  /// Bytes of one stored group scale.
  static int64_t stored_scale_bytes(const W4Layout& w) {
    return w.format == W4Format::mxfp4 ? MxScaleBytes : w.scale_bytes();
  }
  static int64_t codes_bytes(const W4Layout& w) { return Nr * w.group * w.code_bits() / 8; }
  static int64_t scales_bytes(const W4Layout& w) {
    return round_up(Nr * stored_scale_bytes(w), 4);
  }
  static int64_t group_bytes(const W4Layout& w) { return codes_bytes(w) + scales_bytes(w); }
  static size_t block_bytes(int64_t k, const W4Layout& w) {
    return size_t(round_up((k / w.group) * group_bytes(w), 64));
  }
  static size_t rhs_size(int64_t n, int64_t k, const W4Layout& w) {
    return size_t((n + Nr - 1) / Nr) * block_bytes(k, w);
  }
  static size_t rhs_offset(int64_t n_idx, int64_t k, const W4Layout& w) {
    return size_t(n_idx / Nr) * block_bytes(k, w);
  }
};

/// The codes as given (the usual Recode of pack_rhs_q4).
struct KeepCodes {
  static uint8_t code(uint8_t c, int64_t /*idx*/, W4Format /*f*/) { return c; }
};

/// Stores one group scale given as pack_rhs takes it (@p s: fp32 for int4, an E8M0 byte for
/// mxfp4) in Q4Packing<Nr, MxScaleBytes>'s form at @p d.
template <int64_t MxScaleBytes>
void store_group_scale(uint8_t* d, const uint8_t* s, W4Format f) {
  if (f != W4Format::mxfp4) {
    std::memcpy(d, s, 4);
  } else if (MxScaleBytes == 1) {
    *d = *s;
  } else {
    uint32_t bits;
    const float v = w4_mxfp4_scale(*s);
    std::memcpy(&bits, &v, 4);
    if (MxScaleBytes == 2) bits >>= 16;  // the low half is zero: 2^(e - 128) or the quiet NaN
    std::memcpy(d, &bits, size_t(MxScaleBytes));  // little-endian: the low MxScaleBytes bytes
  }
}

/// Bytes of pack_rhs_q4's `from` table (an int32 per nibble position of a group, @p nib of them),
/// rounded to 64 so the `cols` bytes after it start a cache line.
inline size_t q4_pack_from_bytes(int64_t nib) { return size_t(round_up(nib * 4, 64)); }

/// Q4GemmUkernel::pack_scratch_bytes of pack_rhs_q4 over packing P: its two per-call tables
/// (Nr * group int32, then Nr * group + 1 bytes), 0 when the call packs nothing. Depends on the
/// group only, so one block serves every shape of a layer.
template <class P>
size_t q4_pack_scratch_bytes(int64_t n, int64_t k, const W4Layout& w) {
  if (n <= 0 || w.group <= 0 || k / w.group <= 0) return 0;
  const int64_t nib = P::kNr * w.group;
  return q4_pack_from_bytes(nib) + size_t(round_up(nib + 1, 64));  // 8-bit codes: `from` only
}

/// pack_rhs_q4 for int8_affine's 8-bit codes: each group's Nr * g code bytes placed by
/// P::ByteArrangement::index(c, kk, g) (a position in 0 .. Nr * g, every one used once), stored as
/// ByteArrangement::code(code), padding columns as code(128) (the value 0); then the scales as
/// for int4. The position table lives in the scratch as pack_rhs_q4's `from`.
template <class P>
void pack_rhs_bytes(int64_t n, int64_t k, const W4Layout& w, const uint8_t* codes,
                    int64_t code_stride, const uint8_t* sc, int64_t scale_stride, uint8_t* dst,
                    void* scratch) {
  using B = typename P::ByteArrangement;
  constexpr int64_t Nr = P::kNr;
  const int64_t g = w.group, groups = k / g;
  auto* to = static_cast<int32_t*>(scratch);  // to[c * g + kk]: the byte's position
  for (int64_t c = 0; c < Nr; ++c)
    for (int64_t kk = 0; kk < g; ++kk) to[c * g + kk] = int32_t(B::index(c, kk, g));
  uint8_t rec[256];
  for (int c = 0; c < 256; ++c) rec[c] = B::code(uint8_t(c));
  for (int64_t j0 = 0; j0 < n; j0 += Nr) {
    uint8_t* blk = dst + size_t(j0 / Nr) * P::block_bytes(k, w);
    const size_t used = size_t(groups * P::group_bytes(w));
    std::memset(blk + used, 0, P::block_bytes(k, w) - used);
    const int64_t valid = std::min(Nr, n - j0);
    for (int64_t gi = 0; gi < groups; ++gi) {
      uint8_t* grp = blk + size_t(gi * P::group_bytes(w));
      for (int64_t c = 0; c < Nr; ++c) {
        const int32_t* t = to + c * g;
        if (c < valid) {
          const uint8_t* col = codes + (j0 + c) * code_stride + gi * g;
          for (int64_t kk = 0; kk < g; ++kk) grp[t[kk]] = rec[col[kk]];
        } else {
          for (int64_t kk = 0; kk < g; ++kk) grp[t[kk]] = rec[128];
        }
      }
      std::memset(grp + P::codes_bytes(w), 0, size_t(P::scales_bytes(w)));
      for (int64_t c = 0; c < valid; ++c)
        std::memcpy(grp + P::codes_bytes(w) + 4 * c, sc + ((j0 + c) * scale_stride + gi) * 4, 4);
    }
  }
}

/// Q4GemmUkernel::pack_rhs for packing P whose nibble arrangement is Arrange::index(c, kk, g):
/// the position (0 .. Nr * g) of column c's code kk (0 <= kk < g) in its group's code bytes (byte
/// index / 2, low nibble when even). Recode::code(code, position, format) is the nibble stored
/// there (a kernel may store some codes offset); it may depend on the position only through
/// position % 2 (which nibble of the byte). Padding columns store the recoded code 0; a position
/// no (c, kk) maps to stays 0.
/// The arrangement is the same in every group, so it is read once per call into a table of
/// where each nibble comes from, and every group's code bytes are then written in order from the
/// group's Nr columns gathered side by side (several times faster than placing each code by its
/// index: packing a layer is a model's start-up time). Both tables live in the caller's scratch
/// (q4_pack_scratch_bytes<P>): the packer runs in PackedExperts' parallel loop, where a kernel
/// must not allocate.
template <class P, class Arrange, class Recode = KeepCodes>
void pack_rhs_q4(int64_t n, int64_t k, const W4Layout& w, const uint8_t* codes,
                 int64_t code_stride, const void* scales, int64_t scale_stride, void* packed,
                 void* scratch) {
  constexpr int64_t Nr = P::kNr;
  const int64_t g = w.group, groups = k / g, sb = w.scale_bytes(), nib = Nr * g;
  const auto* sc = static_cast<const uint8_t*>(scales);
  auto* dst = static_cast<uint8_t*>(packed);
  if (n <= 0 || groups <= 0) return;
  if constexpr (P::kCodes8) {
    if (w.format == W4Format::int8_affine) {
      pack_rhs_bytes<P>(n, k, w, codes, code_stride, sc, scale_stride, dst, scratch);
      return;
    }
  }
  // from[position] = c * g + kk, or nib where no code goes: cols[nib] holds 16, which rec maps to
  // 0 in both nibbles (the position stays 0, not recoded). Scratch layout as in
  // q4_pack_scratch_bytes.
  auto* from = static_cast<int32_t*>(scratch);
  uint8_t* cols = static_cast<uint8_t*>(scratch) + q4_pack_from_bytes(nib);
  std::fill(from, from + nib, int32_t(nib));
  for (int64_t c = 0; c < Nr; ++c)
    for (int64_t kk = 0; kk < g; ++kk) from[size_t(Arrange::index(c, kk, g))] = int32_t(c * g + kk);
  // Recoded nibble by position parity, plus the untouched hole value at index 16.
  uint8_t rec[2][17];
  for (int p = 0; p < 2; ++p) {
    for (int c = 0; c < 16; ++c) rec[p][c] = uint8_t(Recode::code(uint8_t(c), p, w.format) & 15);
    rec[p][16] = 0;
  }
  // The group's Nr columns side by side, then 16.
  cols[size_t(nib)] = 16;
  for (int64_t j0 = 0; j0 < n; j0 += Nr) {
    uint8_t* blk = dst + size_t(j0 / Nr) * P::block_bytes(k, w);
    const size_t used = size_t(groups * P::group_bytes(w));
    std::memset(blk + used, 0, P::block_bytes(k, w) - used);
    const int64_t valid = std::min(Nr, n - j0);
    std::memset(cols + valid * g, 0, size_t((Nr - valid) * g));  // padding columns: 0
    for (int64_t gi = 0; gi < groups; ++gi) {
      uint8_t* grp = blk + size_t(gi * P::group_bytes(w));
      for (int64_t c = 0; c < valid; ++c) {
        const uint8_t* col = codes + (j0 + c) * code_stride + gi * g;
        uint8_t* d = cols + c * g;
        for (int64_t kk = 0; kk < g; ++kk) d[kk] = uint8_t(col[kk] & 15);
      }
      for (int64_t b = 0; b < nib / 2; ++b)
        grp[b] = uint8_t(rec[0][cols[size_t(from[size_t(2 * b)])]] |
                         rec[1][cols[size_t(from[size_t(2 * b + 1)])]] << 4);
      std::memset(grp + P::codes_bytes(w), 0, size_t(P::scales_bytes(w)));
      for (int64_t c = 0; c < valid; ++c)
        store_group_scale<P::kMxScaleBytes>(grp + P::codes_bytes(w) + c * P::stored_scale_bytes(w),
                                            sc + ((j0 + c) * scale_stride + gi) * sb, w.format);
    }
  }
}

/// The fp32 scale of column c of a packed group (scale bytes at @p s).
inline float group_scale(const uint8_t* s, int64_t c, W4Format f) {
  if (f == W4Format::mxfp4) return w4_mxfp4_scale(s[c]);
  float v;
  std::memcpy(&v, s + 4 * c, 4);
  return v;
}

/// dst[j] = acc[j] * lhs_scale + bias[j] for j < n (the scalar final step of every kernel).
inline void store_q4_row(float* dst, const float* acc, int64_t n, float lhs_scale,
                         const float* bias) {
  if (bias != nullptr) {
    for (int64_t j = 0; j < n; ++j) dst[j] = acc[j] * lhs_scale + bias[j];
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = acc[j] * lhs_scale;
  }
}

/// Q4GemmUkernel::scratch_bytes of a kernel that needs no scratch.
inline size_t q4_no_scratch(int64_t, int64_t, int64_t, const W4Layout&) { return 0; }

/// The interface table of a q4gemm kernel whose A is packed as LhsP (a QGemmPacking) and B as
/// RhsP (a Q4Packing) by @p pack_rhs, a pack_rhs_q4<RhsP, ...> (its scratch is
/// q4_pack_scratch_bytes<RhsP>); kr is that of LhsP.
template <class LhsP, class RhsP>
constexpr Q4GemmUkernel make_q4gemm(const char* name, Isa isa, int64_t mr,
                                    decltype(Q4GemmUkernel::pack_lhs) pack_lhs,
                                    decltype(Q4GemmUkernel::pack_rhs) pack_rhs,
                                    decltype(Q4GemmUkernel::run_f32) run_f32,
                                    decltype(Q4GemmUkernel::scratch_bytes) scratch_bytes =
                                        q4_no_scratch) {
  static_assert(kW4GroupMultiple % LhsP::kKr == 0, "K is never padded: kr must divide 32");
  return Q4GemmUkernel{name,           isa,          mr,           RhsP::kNr,
                       LhsP::kKr,      RhsP::kCodes8,  LhsP::lhs_size, LhsP::lhs_offset, pack_lhs,
                       RhsP::rhs_size, RhsP::rhs_offset, q4_pack_scratch_bytes<RhsP>,
                       pack_rhs,       scratch_bytes,  run_f32};
}

}  // namespace
}  // namespace cpumoe
