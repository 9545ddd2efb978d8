// f8gemm_f32r_f8ck8_8x8_neon: the W8A16 FP8 GEMM on plain Armv8.0 Advanced SIMD (every AArch64
// CPU: Cortex-A57/A72, Neoverse N1 and later), FMLA on fp32.
//
// A is `f32r` (bf16 widened to fp32 once at packing, as the portable kernel has it). B is the
// F8Packing of blocks of 8 columns with each group k-major (`f8ck8`: the 8 codes of one k
// contiguous, so 16 bytes are 2 k x 8 columns), codes and scales as given (KeepF8).
//
// Decode, exact, in registers: an E4M3 code c moved into fp16 bit positions,
// h = ((c & 0x80) << 8) | ((c & 0x7F) << 7), is the fp16 of e4m3(c) * 2^-8 (the 4 exponent bits
// land in the low 4 of fp16's 5 with a bias of 15 instead of 7; E4M3 subnormals are fp16
// subnormals with the same mantissa), and FCVTL (fp16 -> fp32, base Armv8.0 Advanced SIMD) widens
// it exactly, subnormals included. sshll #7 of the signed byte puts the sign in bits 15 and 14 and
// c & 0x7F in bits 13-7; bic clears bit 14: per 16 codes one q load, sshll + sshll2, two bic and
// four fcvtl / fcvtl2 (8 instructions, 0.5 per weight), reused by every row of the tile. The
// factor 2^8 goes to the group sums: at a group's end each sum is multiplied by 256 (exact),
// then by the group's scale (one rounding: the same as the real sum times the scale, barring
// fp32 underflow, and with no overflow for scales of 2^120 and beyond), then added to the
// output's total (acc + S_g * s_g in increasing g, the interface's arithmetic; no FMA there).
//
// Within a group, FMLA by element: per 4 k, one q load of A per row (4 k), then per k and row two
// FMLA (8 columns) with the row's lane k. Every output's group sum runs over its k in order, one
// FMLA chain per 4 columns, whatever the tile, so the bits never depend on the call's m, n or
// offsets. The products are exact in fp32 (bf16 x 4-bit significand), so FMLA's single rounding
// is that of the sum.
//
// Tiles (rows x column blocks; group sums in registers, totals in a stack array touched once per
// group): m <= 2: m x 4 blocks (8 or 16 chains: decode, every weight used once); m <= 4: m x 2;
// otherwise 8 x 1 (16 accumulators, 8 A and 4 B registers), row tails of the same 8 x 1 shape
// with fewer rows. Column blocks are the outer loop: a block's codes stay in L1 across the row
// tiles. Per 2 k and 8 columns an 8-row tile executes 1 load + 8 decode + 32 FMLA + 4 A loads.
//
// @pre m, n >= 0, k >= 1; packed buffers from this kernel's packers.
// Features used: Advanced SIMD only (FMLA by element, SSHLL, BIC, FCVTL: all Armv8.0).
#if !defined(__aarch64__) || !defined(__ARM_NEON)
#error "f8gemm_f32r_f8ck8_8x8_neon.cpp needs AArch64 Advanced SIMD (-march=armv8-a, set per file by CMake)"
#endif

#include <arm_neon.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ukernels/common/arm/neon_common.h"  // store_row_f32x8
#include "ukernels/f8gemm/f8gemm_common.h"

namespace cpumoe {
namespace {

using Packing = F8Packing</*Nr=*/8, /*Kr=*/4, /*LhsBytes=*/4>;
constexpr int64_t kMr = 8;
constexpr int64_t kNr = Packing::kNr;

using Call = F8Call;  // what every tile of one call shares

// 16 codes (2 k x 8 columns, k-major) -> the fp32 values times 2^-8: d[0], d[1] columns 0-3, 4-7
// of the first k, d[2], d[3] of the second.
__attribute__((always_inline)) inline void decode16(const uint8_t* p, float32x4_t (&d)[4]) {
  const int8x16_t c = vreinterpretq_s8_u8(vld1q_u8(p));
  const int16x8_t bit14 = vdupq_n_s16(0x4000);
  const int16x8_t h0 = vbicq_s16(vshll_n_s8(vget_low_s8(c), 7), bit14);
  const int16x8_t h1 = vbicq_s16(vshll_high_n_s8(c, 7), bit14);
  d[0] = vcvt_f32_f16(vreinterpret_f16_s16(vget_low_s16(h0)));
  d[1] = vcvt_high_f32_f16(vreinterpretq_f16_s16(h0));
  d[2] = vcvt_f32_f16(vreinterpret_f16_s16(vget_low_s16(h1)));
  d[3] = vcvt_high_f32_f16(vreinterpretq_f16_s16(h1));
}

// acc[r][2 nb + h] += d[2 x + h] * A row r's lane L + x, for the 2 k of one decode16.
template <int MR, int NB, int L>
__attribute__((always_inline)) inline void fmla2(float32x4_t (&acc)[MR][2 * NB], int nb,
                                                 const float32x4_t (&d)[4],
                                                 const float32x4_t (&av)[MR]) {
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    acc[r][2 * nb] = vfmaq_laneq_f32(acc[r][2 * nb], d[0], av[r], L);
    acc[r][2 * nb + 1] = vfmaq_laneq_f32(acc[r][2 * nb + 1], d[1], av[r], L);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    acc[r][2 * nb] = vfmaq_laneq_f32(acc[r][2 * nb], d[2], av[r], L + 1);
    acc[r][2 * nb + 1] = vfmaq_laneq_f32(acc[r][2 * nb + 1], d[3], av[r], L + 1);
  }
}

// One group of an MR x NB tile: the group sums over gp (a multiple of 4) k from zero (A row r at
// a + r * kp, block nb's codes of the group at b + nb * block_bytes), then the group's end:
// tot[r][8 nb + c] += (sum * 256) * the scale of column c (block nb's scales at
// sc + nb * block_bytes). Not inlined: the loop is register-allocated on its own.
template <int MR, int NB>
__attribute__((noinline)) void group_sums(const float* a, int64_t kp, const uint8_t* b,
                                          int64_t block_bytes, int64_t gp, float* tot,
                                          const uint8_t* sc) {
  float32x4_t acc[MR][2 * NB];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 2 * NB; ++c) acc[r][c] = vdupq_n_f32(0.0f);
  int64_t x = 0;
  do {  // gp >= 4
    float32x4_t av[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) av[r] = vld1q_f32(a + r * kp + x);
#pragma GCC unroll 4
    for (int nb = 0; nb < NB; ++nb) {
      const uint8_t* q = b + nb * block_bytes + x * kNr;
      float32x4_t d[4];
      decode16(q, d);
      fmla2<MR, NB, 0>(acc, nb, d, av);
      decode16(q + 16, d);
      fmla2<MR, NB, 2>(acc, nb, d, av);
    }
    x += 4;
  } while (x < gp);
  const float32x4_t k256 = vdupq_n_f32(256.0f);
#pragma GCC unroll 4
  for (int nb = 0; nb < NB; ++nb) {
    const auto* s = reinterpret_cast<const float*>(sc + nb * block_bytes);
    const float32x4_t s0 = vld1q_f32(s), s1 = vld1q_f32(s + 4);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      float* t = tot + r * 8 * NB + 8 * nb;
      vst1q_f32(t, vaddq_f32(vld1q_f32(t), vmulq_f32(vmulq_f32(acc[r][2 * nb], k256), s0)));
      vst1q_f32(t + 4,
                vaddq_f32(vld1q_f32(t + 4), vmulq_f32(vmulq_f32(acc[r][2 * nb + 1], k256), s1)));
    }
  }
}

// An MR x NB tile over the whole depth: rows of A at a (kp apart), NB blocks of B from b, the
// destination's rows at dst (dst_stride apart), cols real columns (> 8 (NB - 1)).
template <int MR, int NB>
void tile(const Call& cl, const float* a, const uint8_t* b, float* dst, int64_t dst_stride,
          int64_t cols, const float* bias) {
  float tot[MR][8 * NB];  // the totals, in memory: touched once per group, by group_sums
  std::memset(tot, 0, sizeof tot);
  for (int64_t g = 0; g < cl.groups; ++g) {
    const int64_t gp = Packing::group_kp(g, cl.k, *cl.w);
    const uint8_t* grp = b + g * cl.gstride;
    group_sums<MR, NB>(a + g * cl.gk, cl.kp, grp, cl.block_bytes, gp, &tot[0][0],
                       grp + Packing::codes_bytes(gp, *cl.w));
  }
  for (int r = 0; r < MR; ++r)
    for (int nb = 0; nb < NB; ++nb)
      store_row_f32x8(dst + r * dst_stride + 8 * nb, vld1q_f32(tot[r] + 8 * nb),
                      vld1q_f32(tot[r] + 8 * nb + 4), std::min<int64_t>(8, cols - 8 * nb),
                      bias != nullptr ? bias + 8 * nb : nullptr);
}

using TileFn = void (*)(const Call&, const float*, const uint8_t*, float*, int64_t, int64_t,
                        const float*);
// By [rows][blocks]: the shapes run_f32 below can ask for.
constexpr TileFn kTiles[9][5] = {
    {},
    {nullptr, tile<1, 1>, tile<1, 2>, tile<1, 3>, tile<1, 4>},
    {nullptr, tile<2, 1>, tile<2, 2>, tile<2, 3>, tile<2, 4>},
    {nullptr, tile<3, 1>, tile<3, 2>},
    {nullptr, tile<4, 1>, tile<4, 2>},
    {nullptr, tile<5, 1>},
    {nullptr, tile<6, 1>},
    {nullptr, tile<7, 1>},
    {nullptr, tile<8, 1>},
};

void run_f32(int64_t m, int64_t n, int64_t k, const F8Layout& w, const void* lhs, const void* rhs,
             float* dst, int64_t dst_stride, const F8GemmEpilogue& ep) {
  if (m <= 0 || n <= 0) return;
  const Call cl = f8_call<Packing>(k, w);
  const auto* a = static_cast<const float*>(lhs);
  const auto* b = static_cast<const uint8_t*>(rhs);
  const int64_t blocks = (n + kNr - 1) / kNr;
  const int64_t step = m <= 2 ? 4 : m <= 4 ? 2 : 1;  // column blocks per tile
  for (int64_t jb = 0; jb < blocks; jb += step) {
    const int64_t nb = std::min(step, blocks - jb), j0 = jb * kNr;
    const int64_t cols = std::min(nb * kNr, n - j0);
    const uint8_t* bj = b + jb * cl.block_bytes;
    for (int64_t i0 = 0; i0 < m; i0 += kMr) {
      const int64_t rows = std::min(kMr, m - i0);
      kTiles[rows][nb](cl, a + i0 * cl.kp, bj, dst + i0 * dst_stride + j0, dst_stride, cols,
                       ep.bias != nullptr ? ep.bias + j0 : nullptr);
    }
  }
}

}  // namespace

extern const F8GemmUkernel f8gemm_f32r_f8ck8_8x8_neon = make_f8gemm<Packing>(
    "f8gemm_f32r_f8ck8_8x8_neon", Isa::neon, kMr, pack_lhs_f32r<Packing>,
    pack_rhs_f8<Packing, F8Interleaved<kNr, 1>>, run_f32);

}  // namespace cpumoe
