// qgemm_qs8p2x8_qs8cp8x8_8x8_neon_i8mm: the int8 GEMM on SMMLA (Armv8.6 FEAT_I8MM).
//
// SMMLA multiplies a 2x8 int8 block of A by an 8x2 block of B^T into a 2x2 int32 block, so both
// operands are packed in 8-k slices of pairs:
//   A: row pair p occupies 2 * kp bytes at p * 2 * kp; slice s holds row 2p [8s, 8s+8) then row
//      2p+1 [8s, 8s+8) (16 bytes: one q register).
//   B: block b of 8 output columns occupies 8 * kp bytes at b * 8 * kp; slice s holds the four
//      column pairs (64 bytes: four q registers), pair c = columns 2c, 2c+1.
// The 8x8 register tile keeps 16 int32x4 accumulators (4 row pairs x 4 column pairs) for the whole
// K, loading 4 + 4 q registers per 16 SMMLA. Fewer rows (1..7 left over, or decode with 1..4
// tokens per expert) run the same loop with 1..3 row pairs, so no row of work is wasted beyond the
// pair padding. K pads to 8 and N to 8 with zeros at packing.
// Features used: NEON, I8MM.
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_MATMUL_INT8)
#error "qgemm_qs8p2x8_qs8cp8x8_8x8_neon_i8mm.cpp needs -march=armv8.2-a+i8mm (set per file by CMake)"
#endif

#include <arm_neon.h>

#include <algorithm>
#include <cstring>

#include "cpumoe/qgemm.h"
#include "ukernels/qgemm_neon_common.h"

namespace cpumoe {
namespace {

constexpr int64_t kMr = 8;
constexpr int64_t kNr = 8;
constexpr int64_t kKr = 8;

inline int64_t padded_k(int64_t k) { return round_up(k, kKr); }

size_t lhs_size(int64_t m, int64_t k) { return size_t(round_up(m, 2)) * size_t(padded_k(k)); }
size_t lhs_offset(int64_t m_idx, int64_t k) { return size_t(m_idx) * size_t(padded_k(k)); }

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

void pack_lhs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  const int64_t kp = padded_k(k);
  auto* dst = static_cast<int8_t*>(packed);
  for (int64_t p = 0; p * 2 < m; ++p) {
    const int8_t* r0 = rows[2 * p];
    const int8_t* r1 = 2 * p + 1 < m ? rows[2 * p + 1] : nullptr;
    int8_t* d = dst + p * 2 * kp;
    for (int64_t k0 = 0; k0 < kp; k0 += 8, d += 16) {
      copy_slice(d, r0, k0, k);
      copy_slice(d + 8, r1, k0, k);
    }
  }
}

size_t rhs_size(int64_t n, int64_t k) { return size_t(round_up(n, kNr)) * size_t(padded_k(k)); }
size_t rhs_offset(int64_t n_idx, int64_t k) { return size_t(n_idx) * size_t(padded_k(k)); }

void pack_rhs(int64_t n, int64_t k, const int8_t* rhs, int64_t stride, void* packed) {
  const int64_t kp = padded_k(k);
  auto* dst = static_cast<int8_t*>(packed);
  for (int64_t j0 = 0; j0 < n; j0 += kNr) {
    int8_t* d = dst + j0 * kp;
    for (int64_t k0 = 0; k0 < kp; k0 += 8) {
      for (int64_t c = 0; c < kNr; ++c, d += 8) {
        const int64_t j = j0 + c;
        copy_slice(d, j < n ? rhs + j * stride : nullptr, k0, k);
      }
    }
  }
}

// NP row pairs x 4 column pairs, the whole K in registers.
template <int NP>
inline void tile(const int8_t* a, const int8_t* b, int64_t kp, int32x4_t acc[NP][4]) {
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < 4; ++c) acc[p][c] = vdupq_n_s32(0);
  const int64_t pair_stride = 2 * kp;
  for (int64_t s = 0; s < kp / 8; ++s) {
    const int8x16_t b0 = vld1q_s8(b);
    const int8x16_t b1 = vld1q_s8(b + 16);
    const int8x16_t b2 = vld1q_s8(b + 32);
    const int8x16_t b3 = vld1q_s8(b + 48);
    b += 64;
    for (int p = 0; p < NP; ++p) {
      const int8x16_t av = vld1q_s8(a + p * pair_stride);
      acc[p][0] = vmmlaq_s32(acc[p][0], av, b0);
      acc[p][1] = vmmlaq_s32(acc[p][1], av, b1);
      acc[p][2] = vmmlaq_s32(acc[p][2], av, b2);
      acc[p][3] = vmmlaq_s32(acc[p][3], av, b3);
    }
    a += 16;
  }
}

// Hands each finished row (columns 0-3 and 4-7) to the store functor. acc[p][c] holds
// [r0c0 r0c1 r1c0 r1c1] of rows 2p, 2p+1 and columns 2c, 2c+1.
template <int NP, class Store>
inline void emit(int32x4_t acc[NP][4], int64_t rows, int64_t i0, const Store& store) {
  for (int p = 0; p < NP; ++p) {
    const int64x2_t c0 = vreinterpretq_s64_s32(acc[p][0]);
    const int64x2_t c1 = vreinterpretq_s64_s32(acc[p][1]);
    const int64x2_t c2 = vreinterpretq_s64_s32(acc[p][2]);
    const int64x2_t c3 = vreinterpretq_s64_s32(acc[p][3]);
    store(i0 + 2 * p, vreinterpretq_s32_s64(vzip1q_s64(c0, c1)),
          vreinterpretq_s32_s64(vzip1q_s64(c2, c3)));
    if (2 * p + 1 < rows)
      store(i0 + 2 * p + 1, vreinterpretq_s32_s64(vzip2q_s64(c0, c1)),
            vreinterpretq_s32_s64(vzip2q_s64(c2, c3)));
  }
}

template <class Store>
void run(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, const Store& store) {
  const int64_t kp = padded_k(k);
  const auto* a = static_cast<const int8_t*>(lhs);
  const auto* b = static_cast<const int8_t*>(rhs);
  // Column block outer: the block (8 * kp bytes) stays in L1 while every row tile streams past.
  for (int64_t j0 = 0; j0 < n; j0 += kNr) {
    const int64_t nc = std::min(kNr, n - j0);
    const int8_t* bj = b + j0 * kp;
    auto row_store = [&](int64_t i, int32x4_t lo, int32x4_t hi) { store(i, j0, nc, lo, hi); };
    for (int64_t i0 = 0; i0 < m; i0 += kMr) {
      const int64_t rows = std::min(kMr, m - i0);
      const int8_t* ai = a + i0 * kp;
      switch ((rows + 1) / 2) {
        case 4: {
          int32x4_t acc[4][4];
          tile<4>(ai, bj, kp, acc);
          emit<4>(acc, rows, i0, row_store);
          break;
        }
        case 3: {
          int32x4_t acc[3][4];
          tile<3>(ai, bj, kp, acc);
          emit<3>(acc, rows, i0, row_store);
          break;
        }
        case 2: {
          int32x4_t acc[2][4];
          tile<2>(ai, bj, kp, acc);
          emit<2>(acc, rows, i0, row_store);
          break;
        }
        default: {
          int32x4_t acc[1][4];
          tile<1>(ai, bj, kp, acc);
          emit<1>(acc, rows, i0, row_store);
          break;
        }
      }
    }
  }
}

void run_s32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, int32_t* dst,
             int64_t dst_stride) {
  run(m, n, k, lhs, rhs, [&](int64_t i, int64_t j0, int64_t nc, int32x4_t lo, int32x4_t hi) {
    neon_store_s32(dst + i * dst_stride + j0, lo, hi, nc);
  });
}

void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  run(m, n, k, lhs, rhs, [&](int64_t i, int64_t j0, int64_t nc, int32x4_t lo, int32x4_t hi) {
    neon_store_f32(dst + i * dst_stride + j0, lo, hi, nc, ep.lhs_scale[i], ep.rhs_scale + j0,
                   ep.bias ? ep.bias + j0 : nullptr);
  });
}

}  // namespace

extern const QGemmUkernel qgemm_qs8p2x8_qs8cp8x8_8x8_neon_i8mm = {
    "qgemm_qs8p2x8_qs8cp8x8_8x8_neon_i8mm",
    Isa::neon_i8mm,
    kMr,
    kNr,
    kKr,
    lhs_size,
    lhs_offset,
    pack_lhs,
    rhs_size,
    rhs_offset,
    pack_rhs,
    run_s32,
    run_f32,
};

}  // namespace cpumoe
