// qgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16: the int8 GEMM (W8A8) on BFMMLA, for CPUs with FEAT_BF16
// but without FEAT_I8MM. It has the int8 interface of every qgemm kernel and gives the SAME int32
// results as the SMMLA kernel, bit for bit, and so the same fp32 epilogue.
//
// This is how "the int8 op falls back to the BF16 kernel with weights dequantized once at
// prepack" is realised without losing exactness: pack_rhs converts the int8 weights to bf16 once
// (at prepack: every int8 value is exact in bf16, which has 8 significant bits), pack_lhs converts
// the int8 activation rows of each call to bf16 (exact too), and the dequantization by the scales
// stays in the int32 -> fp32 epilogue, as on the int8 paths. BFMMLA multiplies a 2x4 bf16 block of
// A by a 4x2 block of B^T into a 2x2 fp32 block. Over a K block of at most kKBlock = 1024, every
// partial sum is an integer with |sum| <= 1024 * 128 * 128 = 2^24, and every such integer is an
// fp32 value: no product, addition or rounding inside BFMMLA (whatever its intermediate rounding,
// round-to-odd or not, FPCR.EBF or not) can be inexact. Each block's fp32 sums are converted to
// int32 (exact) and added in int32, so the result is the exact int32 dot product for any K.
//
// Layout (both operands in 4-k slices of pairs, as SMMLA's in 8-k slices; 2 bytes per element):
//   A (bf16p2x4):  row pair p occupies 2 * kp bf16 at p * 2 * kp, kp = round_up(k, 4); slice s
//                  holds row 2p k [4s, 4s+4) then row 2p+1 (8 bf16: one q register).
//   B (bf16cp8x4): block b of 8 output columns occupies 8 * kp bf16 at b * 8 * kp; slice s holds
//                  the four column pairs (32 bf16: four q registers), pair c = columns 2c, 2c+1.
// The 8x8 register tile keeps 16 fp32x4 accumulators (4 row pairs x 4 column pairs) over a K
// block, loading 4 + 4 q registers per 16 BFMMLA. The block loop is a function of its own, so it
// holds only accumulators and operands (24 q registers, no spills); the int32 totals wait in a
// small stack tile across it (one store and load per 1024 k, i.e. per 4096 BFMMLA at the full
// tile). Fewer rows (1..7) run 1..3 row pairs. K pads to 4 and N to 8 with zeros at packing.
//
// Cost vs SMMLA: one BFMMLA does 2x2x4 MACs, half of SMMLA's 2x2x8, and the packed weights take
// twice the bytes (bf16): about half the int8 throughput, which is the price of exactness here.
// llvm-mca, 8x8 loop (27 instructions per 4 k, no spills): 5.0 cycles on Neoverse V1 (peak 4.0:
// 16 accumulator chains over BFMMLA's latency of 5 allow 3.2 per cycle), 8.0 on N2 (the peak).
// Per 8 k that is 10 / 16 cycles, against 8 / 16 for the SDOT kernel on the same cores.
//
// @pre m, n >= 0, k >= 1; packed buffers from this kernel's packers; A and B any int8 values.
// Features used: NEON, BF16 (BFMMLA; the int8 -> bf16 conversions use plain NEON).
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#error "qgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16.cpp needs -march=armv8.2-a+bf16 (set per file by CMake)"
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
constexpr int64_t kKr = 4;
// The largest K block whose fp32 partial sums are all exact integers: 1024 * 128 * 128 = 2^24.
constexpr int64_t kKBlock = 1024;
static_assert(kKBlock * 128 * 128 <= (int64_t(1) << 24), "fp32 sums of a K block must be exact");
static_assert(kKBlock % kKr == 0, "K blocks hold whole slices");

inline int64_t padded_k(int64_t k) { return round_up(k, kKr); }

// int8 -> bf16 bits, exact: the fp32 of a small integer has a zero low half.
inline uint16_t bf16_of(int8_t v) {
  const float f = float(v);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}

// 8 int8 -> 8 bf16 (exact, as above; uzp2 takes the high halves of the fp32 values).
inline uint16x8_t bf16x8_of(int8x8_t v) {
  const int16x8_t w = vmovl_s8(v);
  const float32x4_t lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
  const float32x4_t hi = vcvtq_f32_s32(vmovl_high_s16(w));
  return vuzp2q_u16(vreinterpretq_u16_f32(lo), vreinterpretq_u16_f32(hi));
}

// Packs the pair of rows (r0, r1) of depth k (nullptr: a zero row) into kp / 4 slices of 8 bf16,
// slice s at dst + s * slice_stride (in bf16): r0 k [4s, 4s+4), then r1 k [4s, 4s+4).
void pack_pair(const int8_t* r0, const int8_t* r1, int64_t k, uint16_t* dst, int64_t slice_stride) {
  const int64_t kp = padded_k(k);
  int64_t k0 = 0;
  if (r0 != nullptr) {  // r1 == nullptr: the padding row of an odd m or n, zeros
    const uint64x2_t zero = vdupq_n_u64(0);
    for (; k0 + 8 <= k; k0 += 8, dst += 2 * slice_stride) {
      const uint64x2_t a = vreinterpretq_u64_u16(bf16x8_of(vld1_s8(r0 + k0)));
      const uint64x2_t b =
          r1 != nullptr ? vreinterpretq_u64_u16(bf16x8_of(vld1_s8(r1 + k0))) : zero;
      vst1q_u16(dst, vreinterpretq_u16_u64(vzip1q_u64(a, b)));
      vst1q_u16(dst + slice_stride, vreinterpretq_u16_u64(vzip2q_u64(a, b)));
    }
  }
  for (; k0 < kp; k0 += 4, dst += slice_stride) {
    for (int x = 0; x < 4; ++x) {
      const int64_t kk = k0 + x;
      dst[x] = r0 != nullptr && kk < k ? bf16_of(r0[kk]) : 0;
      dst[4 + x] = r1 != nullptr && kk < k ? bf16_of(r1[kk]) : 0;
    }
  }
}

size_t lhs_size(int64_t m, int64_t k) { return size_t(round_up(m, 2)) * size_t(padded_k(k)) * 2; }
size_t lhs_offset(int64_t m_idx, int64_t k) { return size_t(m_idx) * size_t(padded_k(k)) * 2; }

void pack_lhs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  const int64_t kp = padded_k(k);
  auto* dst = static_cast<uint16_t*>(packed);
  for (int64_t p = 0; p * 2 < m; ++p)
    pack_pair(rows[2 * p], 2 * p + 1 < m ? rows[2 * p + 1] : nullptr, k, dst + p * 2 * kp, 8);
}

size_t rhs_size(int64_t n, int64_t k) { return size_t(round_up(n, kNr)) * size_t(padded_k(k)) * 2; }
size_t rhs_offset(int64_t n_idx, int64_t k) { return size_t(n_idx) * size_t(padded_k(k)) * 2; }

void pack_rhs(int64_t n, int64_t k, const int8_t* rhs, int64_t stride, void* packed) {
  const int64_t kp = padded_k(k);
  auto* dst = static_cast<uint16_t*>(packed);
  for (int64_t j0 = 0; j0 < n; j0 += kNr) {
    for (int64_t c = 0; c < kNr / 2; ++c) {
      const int64_t j = j0 + 2 * c;
      pack_pair(j < n ? rhs + j * stride : nullptr, j + 1 < n ? rhs + (j + 1) * stride : nullptr,
                k, dst + j0 * kp + 8 * c, 8 * kNr / 2);
    }
  }
}

// NP row pairs x 4 column pairs over `steps` 4-k slices, into fp32 (exact: steps * 4 <= kKBlock).
// Not inlined: the loop is register-allocated on its own, whatever the caller keeps live.
template <int NP>
__attribute__((noinline)) void block(const bfloat16_t* a, const bfloat16_t* b, int64_t steps,
                                     int64_t pair_stride, float32x4_t out[NP][4]) {
  float32x4_t acc[NP][4];
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < 4; ++c) acc[p][c] = vdupq_n_f32(0.0f);
  for (int64_t s = 0; s < steps; ++s) {
    const bfloat16x8_t b0 = vld1q_bf16(b);
    const bfloat16x8_t b1 = vld1q_bf16(b + 8);
    const bfloat16x8_t b2 = vld1q_bf16(b + 16);
    const bfloat16x8_t b3 = vld1q_bf16(b + 24);
    b += 32;
    for (int p = 0; p < NP; ++p) {
      const bfloat16x8_t av = vld1q_bf16(a + p * pair_stride);
      acc[p][0] = vbfmmlaq_f32(acc[p][0], av, b0);
      acc[p][1] = vbfmmlaq_f32(acc[p][1], av, b1);
      acc[p][2] = vbfmmlaq_f32(acc[p][2], av, b2);
      acc[p][3] = vbfmmlaq_f32(acc[p][3], av, b3);
    }
    a += 8;
  }
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < 4; ++c) out[p][c] = acc[p][c];
}

// The whole K of NP row pairs x 4 column pairs as exact int32: K blocks of at most kKBlock in
// fp32, each converted to int32 and summed.
template <int NP>
inline void tile(const bfloat16_t* a, const bfloat16_t* b, int64_t kp, int32x4_t acc[NP][4]) {
  const int64_t pair_stride = 2 * kp;
  float32x4_t f[NP][4];
  block<NP>(a, b, std::min(kp, kKBlock) / 4, pair_stride, f);
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < 4; ++c) acc[p][c] = vcvtq_s32_f32(f[p][c]);
  for (int64_t k0 = kKBlock; k0 < kp; k0 += kKBlock) {
    block<NP>(a + 2 * k0, b + 8 * k0, std::min(kp - k0, kKBlock) / 4, pair_stride, f);
    for (int p = 0; p < NP; ++p)
      for (int c = 0; c < 4; ++c) acc[p][c] = vaddq_s32(acc[p][c], vcvtq_s32_f32(f[p][c]));
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

template <int NP, class Store>
inline void tile_and_emit(const bfloat16_t* a, const bfloat16_t* b, int64_t kp, int64_t rows,
                          int64_t i0, const Store& store) {
  int32x4_t acc[NP][4];
  tile<NP>(a, b, kp, acc);
  emit<NP>(acc, rows, i0, store);
}

template <class Store>
void run(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, const Store& store) {
  const int64_t kp = padded_k(k);
  const auto* a = static_cast<const bfloat16_t*>(lhs);
  const auto* b = static_cast<const bfloat16_t*>(rhs);
  // Column block outer: the block (16 * kp bytes) stays in L1 while every row tile streams past.
  for (int64_t j0 = 0; j0 < n; j0 += kNr) {
    const int64_t nc = std::min(kNr, n - j0);
    const bfloat16_t* bj = b + j0 * kp;
    auto row_store = [&](int64_t i, int32x4_t lo, int32x4_t hi) { store(i, j0, nc, lo, hi); };
    for (int64_t i0 = 0; i0 < m; i0 += kMr) {
      const int64_t rows = std::min(kMr, m - i0);
      const bfloat16_t* ai = a + i0 * kp;
      switch ((rows + 1) / 2) {
        case 4: tile_and_emit<4>(ai, bj, kp, rows, i0, row_store); break;
        case 3: tile_and_emit<3>(ai, bj, kp, rows, i0, row_store); break;
        case 2: tile_and_emit<2>(ai, bj, kp, rows, i0, row_store); break;
        default: tile_and_emit<1>(ai, bj, kp, rows, i0, row_store); break;
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

extern const QGemmUkernel qgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16 = {
    "qgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16",
    Isa::neon_bf16,
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
