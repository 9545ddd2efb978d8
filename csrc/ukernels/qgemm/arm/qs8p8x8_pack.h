// The `qs8p8x8` lhs layout (the SMMLA operand: blocks of 8 rows, row pairs interleaved in 8-k
// slices; see qgemm_qs8p8x8_qs8cp8x8_8x8_neon_i8mm.cpp) and its packer, shared by the int8 and the
// W4A8 I8MM kernels, which read the same packed activations.
// Internal linkage on purpose (see qgemm_neon_common.h). Plain NEON (and GCC inline asm), so any
// AArch64 kernel file may include it.
#pragma once

#if !defined(__aarch64__)
#error "qs8p8x8_pack.h is for AArch64 kernel files only"
#endif

#include <arm_neon.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace cpumoe {
namespace {

constexpr int64_t kQs8p8x8Slice = 64;  // bytes of one 8-k slice of an 8-row block

// Copies up to 8 bytes of a row slice, zero-filling past k (or all of it for a padding row).
inline void copy_slice(int8_t* dst, const int8_t* row, int64_t k0, int64_t k) {
  if (row != nullptr && k0 + 8 <= k) {
    std::memcpy(dst, row + k0, 8);
    return;
  }
  std::memset(dst, 0, 8);
  if (row == nullptr) return;
  for (int64_t x = k0; x < k; ++x) dst[x - k0] = row[x];
}

// One row pair (r1 may be nullptr: a zero row) into its 16 bytes of every slice of a block at dst.
inline void pack_pair(const int8_t* r0, const int8_t* r1, int64_t k, int64_t kp, int8_t* dst) {
  int64_t k0 = 0;
  // Two slices per step: 16 bytes of each row, zipped by 8 into the two slices' pair entries.
  const int64x2_t z = vdupq_n_s64(0);
  for (; k0 + 16 <= k; k0 += 16, dst += 2 * kQs8p8x8Slice) {
    const int64x2_t a = vreinterpretq_s64_s8(vld1q_s8(r0 + k0));
    const int64x2_t b = r1 != nullptr ? vreinterpretq_s64_s8(vld1q_s8(r1 + k0)) : z;
    vst1q_s8(dst, vreinterpretq_s8_s64(vzip1q_s64(a, b)));
    vst1q_s8(dst + kQs8p8x8Slice, vreinterpretq_s8_s64(vzip2q_s64(a, b)));
  }
  for (; k0 < kp; k0 += 8, dst += kQs8p8x8Slice) {
    copy_slice(dst, r0, k0, k);
    copy_slice(dst + 8, r1, k0, k);
  }
}

// Zeroes pairs [np, 4) of every slice of a block (the padding of the last block).
inline void zero_pairs(int64_t np, int64_t kp, int8_t* dst) {
  const int8x16_t z = vdupq_n_s8(0);
  for (int8_t* d = dst + np * 16; d < dst + kp * 8; d += kQs8p8x8Slice) {
    vst1q_s8(d, z);
    if (np < 3) vst1q_s8(d + 16, z);
    if (np < 2) vst1q_s8(d + 32, z);
  }
}

// A block of r valid rows (1-8; the rest zero): 4 slices (32 k) per step in asm, all 8 rows at
// once: one ld1 of 32 bytes per row (rows past r read 32 zero bytes, not advanced), zip1/zip2
// per pair and slice, one st1 of 64 bytes per slice (30 instructions per 256 bytes). Then the
// last k % 32 through pack_pair.
alignas(64) constexpr int8_t kZeroRow[32] = {};

inline void pack_block(const int8_t* const* rows, int64_t r, int64_t k, int64_t kp, int8_t* dst) {
  const int8_t* p[8];
  int64_t inc[8];
  for (int i = 0; i < 8; ++i) {
    p[i] = i < r ? rows[i] : kZeroRow;
    inc[i] = i < r ? 32 : 0;
  }
  if (const uint64_t steps = uint64_t(k) / 32; steps > 0) {
    uint64_t n = steps;
    __asm__ volatile(
        "1:\n\t"
        "ld1 {v16.16b, v17.16b}, [%[p0]], %[i0]\n\t"
        "ld1 {v18.16b, v19.16b}, [%[p1]], %[i1]\n\t"
        "ld1 {v20.16b, v21.16b}, [%[p2]], %[i2]\n\t"
        "ld1 {v22.16b, v23.16b}, [%[p3]], %[i3]\n\t"
        "ld1 {v24.16b, v25.16b}, [%[p4]], %[i4]\n\t"
        "ld1 {v26.16b, v27.16b}, [%[p5]], %[i5]\n\t"
        "ld1 {v28.16b, v29.16b}, [%[p6]], %[i6]\n\t"
        "ld1 {v30.16b, v31.16b}, [%[p7]], %[i7]\n\t"
        "zip1 v0.2d, v16.2d, v18.2d\n\tzip1 v1.2d, v20.2d, v22.2d\n\t"
        "zip1 v2.2d, v24.2d, v26.2d\n\tzip1 v3.2d, v28.2d, v30.2d\n\t"
        "zip2 v4.2d, v16.2d, v18.2d\n\tzip2 v5.2d, v20.2d, v22.2d\n\t"
        "zip2 v6.2d, v24.2d, v26.2d\n\tzip2 v7.2d, v28.2d, v30.2d\n\t"
        "st1 {v0.16b-v3.16b}, [%[d]], #64\n\t"
        "st1 {v4.16b-v7.16b}, [%[d]], #64\n\t"
        "zip1 v0.2d, v17.2d, v19.2d\n\tzip1 v1.2d, v21.2d, v23.2d\n\t"
        "zip1 v2.2d, v25.2d, v27.2d\n\tzip1 v3.2d, v29.2d, v31.2d\n\t"
        "zip2 v4.2d, v17.2d, v19.2d\n\tzip2 v5.2d, v21.2d, v23.2d\n\t"
        "zip2 v6.2d, v25.2d, v27.2d\n\tzip2 v7.2d, v29.2d, v31.2d\n\t"
        "st1 {v0.16b-v3.16b}, [%[d]], #64\n\t"
        "st1 {v4.16b-v7.16b}, [%[d]], #64\n\t"
        "subs %[n], %[n], #1\n\t"
        "b.ne 1b\n\t"
        : [p0] "+r"(p[0]), [p1] "+r"(p[1]), [p2] "+r"(p[2]), [p3] "+r"(p[3]), [p4] "+r"(p[4]),
          [p5] "+r"(p[5]), [p6] "+r"(p[6]), [p7] "+r"(p[7]), [d] "+r"(dst), [n] "+r"(n)
        : [i0] "r"(inc[0]), [i1] "r"(inc[1]), [i2] "r"(inc[2]), [i3] "r"(inc[3]),
          [i4] "r"(inc[4]), [i5] "r"(inc[5]), [i6] "r"(inc[6]), [i7] "r"(inc[7])
        : "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v16", "v17", "v18", "v19", "v20",
          "v21", "v22", "v23", "v24", "v25", "v26", "v27", "v28", "v29", "v30", "v31", "cc",
          "memory");
  }
  const int64_t k0 = k / 32 * 32;
  if (k0 >= kp) return;
  for (int64_t q = 0; q < 4; ++q) {
    if (2 * q >= r) {
      zero_pairs(q, kp - k0, dst);
      return;
    }
    pack_pair(rows[2 * q] + k0, 2 * q + 1 < r ? rows[2 * q + 1] + k0 : nullptr, k - k0, kp - k0,
              dst + q * 16);
  }
}

/// The `qs8p8x8` lhs layout of m rows of depth k (kp = round_up(k, 8)) at dst: blocks of 8 rows.
inline void pack_lhs_qs8p8x8(int64_t m, int64_t k, int64_t kp, const int8_t* const* rows,
                             int8_t* dst) {
  for (int64_t b0 = 0; b0 < m; b0 += 8)
    pack_block(rows + b0, std::min<int64_t>(8, m - b0), k, kp, dst + b0 * kp);
}

}  // namespace
}  // namespace cpumoe
