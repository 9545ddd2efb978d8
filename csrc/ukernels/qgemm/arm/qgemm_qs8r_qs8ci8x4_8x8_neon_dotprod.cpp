// qgemm_qs8r_qs8ci8x4_8x8_neon_dotprod: the int8 GEMM on SDOT (Armv8.2 FEAT_DotProd), for CPUs
// with dotprod but without I8MM (Neoverse N1: Graviton 2, Ampere Altra).
//
// SDOT by element, vdotq_laneq_s32(acc, b, a, g), adds to each of the four int32 lanes of acc the
// dot product of one 4-byte group of b with the 4-byte group g of a. So B is packed with one
// output column per lane and A stays row-major, one q register holding 16 k of one row:
//   A (qs8r):     row i occupies kp bytes at i * kp, kp = round_up(k, 16), zero-padded.
//   B (qs8ci8x4): block b of 8 output columns occupies 8 * kp bytes at b * 8 * kp; 4-k group g
//                 occupies 32 bytes at g * 32: columns 0..3 (column c's k [4g, 4g+4) at 4c), then
//                 columns 4..7 (two q registers).
// The 8x8 register tile keeps 16 int32x4 accumulators (8 rows x 2 column quads) for the whole K;
// per 16 k it loads 8 A and 8 B q registers for 64 SDOT (0.25 loads per SDOT, each SDOT 16 useful
// MACs: no lane ever multiplies padding except at the k and n tails). Fewer rows (decode: 1..7
// tokens per expert) run the same loop with R = 1..7 rows and waste nothing. Loads are plain
// ldr/ldp q, so the loop keeps the SIMD pipes for SDOT (ld1r would cost a SIMD slot on N1/V1).
// The 8x8 loop has no spills and runs at the SDOT issue peak in llvm-mca (docs/kernels.md).
//
// Why not SMMLA's packed weights (qs8cp8x8)? SDOT on that layout needs the row's 8-k slice in both
// halves of the a register and leaves lane pairs to be summed: 4 accumulators per row per 8
// columns, so at most a 6x8 tile and 0.4-0.5 loads per SDOT. Its own prepack is cheaper.
//
// @pre m, n >= 0, k >= 1; packed buffers from this kernel's packers. Exact int32 for any int8
//      inputs whose sums fit int32 (|A| <= 127, |B| <= 128: k <= 131072).
// Features used: NEON, DotProd (SDOT).
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_DOTPROD)
#error "qgemm_qs8r_qs8ci8x4_8x8_neon_dotprod.cpp needs -march=armv8.2-a+dotprod (set per file by CMake)"
#endif

#include <arm_neon.h>

#include <algorithm>
#include <cstring>

#include "cpumoe/qgemm.h"
#include "ukernels/qgemm/arm/qgemm_neon_common.h"

namespace cpumoe {
namespace {

constexpr int64_t kMr = 8;
using Packing = QGemmPacking<8, 16>;
constexpr int64_t kNr = Packing::kNr;

void pack_rhs(int64_t n, int64_t k, const int8_t* rhs, int64_t stride, void* packed) {
  const int64_t kp = Packing::padded_k(k);
  auto* dst = static_cast<int8_t*>(packed);
  for (int64_t j0 = 0; j0 < n; j0 += kNr) {
    int8_t* d = dst + j0 * kp;
    const int64_t nc = std::min(kNr, n - j0);
    for (int64_t k0 = 0; k0 < kp; k0 += 4, d += 4 * kNr) {
      std::memset(d, 0, size_t(4 * kNr));
      if (k0 >= k) continue;
      const int64_t kc = std::min<int64_t>(4, k - k0);
      for (int64_t c = 0; c < nc; ++c) std::memcpy(d + 4 * c, rhs + (j0 + c) * stride + k0, size_t(kc));
    }
  }
}

// R rows x 8 columns, the whole K in registers: out[r][0] = columns 0..3, out[r][1] = 4..7.
// Not inlined: the loop is register-allocated on its own (16 accumulators + 8 A + 8 B = 32 q
// registers at R = 8), shared by run_s32 and run_f32, and no epilogue value can push an
// accumulator out to the stack. With few rows the accumulators are split over the 4-k groups
// (S chains per output, summed at the end): each SDOT then waits for one S-th as many
// predecessors, so a 1- or 2-row tile (decode) issues at the SDOT rate instead of its latency.
template <int R>
__attribute__((noinline)) void tile(const int8_t* a, const int8_t* b, int64_t kp,
                                    int32x4_t out[R][2]) {
  constexpr int S = R == 1 ? 4 : R <= 3 ? 2 : 1;
  int32x4_t acc[S][R][2];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) acc[s][r][0] = acc[s][r][1] = vdupq_n_s32(0);
  for (int64_t k0 = 0; k0 < kp; k0 += 16) {
    int8x16_t av[R];
    for (int r = 0; r < R; ++r) av[r] = vld1q_s8(a + r * kp + k0);
    const int8x16_t b0 = vld1q_s8(b), b1 = vld1q_s8(b + 16);
    const int8x16_t b2 = vld1q_s8(b + 32), b3 = vld1q_s8(b + 48);
    for (int r = 0; r < R; ++r) {
      acc[0][r][0] = vdotq_laneq_s32(acc[0][r][0], b0, av[r], 0);
      acc[0][r][1] = vdotq_laneq_s32(acc[0][r][1], b1, av[r], 0);
    }
    for (int r = 0; r < R; ++r) {
      acc[1 % S][r][0] = vdotq_laneq_s32(acc[1 % S][r][0], b2, av[r], 1);
      acc[1 % S][r][1] = vdotq_laneq_s32(acc[1 % S][r][1], b3, av[r], 1);
    }
    const int8x16_t b4 = vld1q_s8(b + 64), b5 = vld1q_s8(b + 80);
    const int8x16_t b6 = vld1q_s8(b + 96), b7 = vld1q_s8(b + 112);
    for (int r = 0; r < R; ++r) {
      acc[2 % S][r][0] = vdotq_laneq_s32(acc[2 % S][r][0], b4, av[r], 2);
      acc[2 % S][r][1] = vdotq_laneq_s32(acc[2 % S][r][1], b5, av[r], 2);
    }
    for (int r = 0; r < R; ++r) {
      acc[3 % S][r][0] = vdotq_laneq_s32(acc[3 % S][r][0], b6, av[r], 3);
      acc[3 % S][r][1] = vdotq_laneq_s32(acc[3 % S][r][1], b7, av[r], 3);
    }
    b += 128;
  }
  for (int r = 0; r < R; ++r) {
    for (int s = 1; s < S; ++s) {
      acc[0][r][0] = vaddq_s32(acc[0][r][0], acc[s][r][0]);
      acc[0][r][1] = vaddq_s32(acc[0][r][1], acc[s][r][1]);
    }
    out[r][0] = acc[0][r][0];
    out[r][1] = acc[0][r][1];
  }
}

template <int R, class Store>
inline void tile_and_store(const int8_t* a, const int8_t* b, int64_t kp, int64_t i0,
                           const Store& store) {
  int32x4_t acc[R][2];
  tile<R>(a, b, kp, acc);
  for (int r = 0; r < R; ++r) store(i0 + r, acc[r][0], acc[r][1]);
}

template <class Store>
void run(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, const Store& store) {
  const int64_t kp = Packing::padded_k(k);
  const auto* a = static_cast<const int8_t*>(lhs);
  const auto* b = static_cast<const int8_t*>(rhs);
  // Column block outer: the block (8 * kp bytes) stays in L1 while every row tile streams past.
  for (int64_t j0 = 0; j0 < n; j0 += kNr) {
    const int64_t nc = std::min(kNr, n - j0);
    const int8_t* bj = b + j0 * kp;
    auto row_store = [&](int64_t i, int32x4_t lo, int32x4_t hi) { store(i, j0, nc, lo, hi); };
    for (int64_t i0 = 0; i0 < m; i0 += kMr) {
      const int8_t* ai = a + i0 * kp;
      switch (std::min(kMr, m - i0)) {
        case 8: tile_and_store<8>(ai, bj, kp, i0, row_store); break;
        case 7: tile_and_store<7>(ai, bj, kp, i0, row_store); break;
        case 6: tile_and_store<6>(ai, bj, kp, i0, row_store); break;
        case 5: tile_and_store<5>(ai, bj, kp, i0, row_store); break;
        case 4: tile_and_store<4>(ai, bj, kp, i0, row_store); break;
        case 3: tile_and_store<3>(ai, bj, kp, i0, row_store); break;
        case 2: tile_and_store<2>(ai, bj, kp, i0, row_store); break;
        default: tile_and_store<1>(ai, bj, kp, i0, row_store); break;
      }
    }
  }
}

void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  run(m, n, k, lhs, rhs, [&](int64_t i, int64_t j0, int64_t nc, int32x4_t lo, int32x4_t hi) {
    neon_store_f32(dst + i * dst_stride + j0, lo, hi, nc, ep.lhs_scale[i], ep.rhs_scale + j0,
                   ep.bias ? ep.bias + j0 : nullptr);
  });
}

}  // namespace

extern const QGemmUkernel qgemm_qs8r_qs8ci8x4_8x8_neon_dotprod = make_qgemm<Packing>(
    "qgemm_qs8r_qs8ci8x4_8x8_neon_dotprod", Isa::neon_dotprod, kMr, pack_lhs_qs8r<Packing>, pack_rhs, run_f32);

}  // namespace cpumoe
