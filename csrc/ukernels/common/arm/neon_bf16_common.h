// The BFMMLA machinery of the two kernels on FEAT_BF16: the bf16 GEMM
// (bgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16) and the exact int8 GEMM on BFMMLA
// (qgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16). They share the packed layouts and their packers, the
// register tiles with their inner loop, and the driver that covers an m x n problem with tiles;
// they differ in what they pack from (bf16 or int8 elements), in how a tile sums over K (fp32 over
// the whole K, or exact int32 over fp32 blocks) and in the row store.
//
// Layouts (2 bytes per element; kp = round_up(k, 4); zeros pad k to kp, m to even, n to 8):
//   A (bf16p2x4):  row pair p occupies 2 * kp bf16 at p * 2 * kp; slice s holds row 2p
//                  k [4s, 4s+4) then row 2p+1 (8 bf16: one q register, BFMMLA's 2x4 operand).
//   B (bf16cp8x4): block b of 8 output columns occupies 8 * kp bf16 at b * 8 * kp; slice s holds
//                  the four column pairs (32 bf16: four q registers), pair c = columns 2c, 2c+1.
// BFMMLA of an A slice and a column pair adds the 2x2 fp32 block [r0c0 r0c1 r1c0 r1c1].
//
// Register tiles: NP row pairs x NB column blocks keep one fp32x4 accumulator per (row pair,
// column pair), 4 * NP * NB in all, each summing its slices in order. An output element is thus
// computed the same way by every tile shape (BFMMLA's four outputs do not interact), so its value
// does not depend on m, n, the tile that covered it or the offsets of the call.
// The accumulators are the independent BFMMLA chains. With a chain latency L per BFMMLA and an
// issue rate R (llvm-19's models: L = 5 on Neoverse V1 and N2, 4 on V2, whose accumulator input
// is forwarded; R = 4 per cycle on V1 and V2, 2 on N2), a tile needs L * R chains to reach the
// peak: 10 on N2, 16 on V2, 20 on V1. So the driver takes
//   - m <= 2 (one row pair, the decode shape): 1 pair x 4 blocks, 2x32, 16 chains;
//   - else 3 pairs x 2 blocks, 6x16, 24 chains (24 accumulators, 3 A and 2 B registers), the row
//     pairs split evenly into tiles of at most 3 (4 pairs: 2 + 2; 7: 3 + 2 + 2; never a lone pair);
//   - in a column tail of one block, up to 4 pairs x 1 block, 8x8, 16 chains.
// llvm-mca, cycles per 4-k slice (V1 / V2 / N2): 6x16 6.0 / 6.0 / 12.0 (24 BFMMLA: the peak on all
// three); 8x8 and 4x16 5.0 / 4.0 / 8.0 (16 BFMMLA: latency-bound on V1, the peak on V2 and N2);
// 2x32 5.7 / 5.7 / 8.5 (16 BFMMLA, each B register used once: 17 ldp per 2 slices fill V1's and
// V2's load pipes).
// Column groups are the outer loop: a group's packed B (16 * kp bytes per block) stays hot while
// the row tiles stream past it.
// Internal linkage on purpose, as in qgemm_common.h: every kernel file has its own ISA flags, and
// a shared inline (weak) copy could be taken by the linker from a file built for a richer ISA.
#pragma once

#if !defined(__aarch64__) || !defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#error "neon_bf16_common.h is for AArch64 kernel files built with +bf16 only"
#endif

#include <arm_neon.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cpumoe/qgemm.h"  // round_up

namespace cpumoe {
namespace {

constexpr int64_t kBf16pKr = 4;  // k per slice: BFMMLA's depth

inline int64_t bf16p_padded_k(int64_t k) { return round_up(k, kBf16pKr); }

inline size_t bf16p2x4_size(int64_t m, int64_t k) {
  return size_t(round_up(m, 2)) * size_t(bf16p_padded_k(k)) * 2;
}
inline size_t bf16p2x4_offset(int64_t m_idx, int64_t k) {
  return size_t(m_idx) * size_t(bf16p_padded_k(k)) * 2;
}
inline size_t bf16cp8x4_size(int64_t n, int64_t k) {
  return size_t(round_up(n, 8)) * size_t(bf16p_padded_k(k)) * 2;
}
inline size_t bf16cp8x4_offset(int64_t n_idx, int64_t k) {
  return size_t(n_idx) * size_t(bf16p_padded_k(k)) * 2;
}

// Packs the pair of rows (r0, r1) of depth k (nullptr: a zero row) into kp / 4 slices of 8 bf16,
// slice s at dst + s * slice_stride (in bf16): r0 k [4s, 4s+4), then r1 k [4s, 4s+4).
// Cvt turns source elements into bf16 bits: `static uint16x8_t eight(const Elem*)` (8 elements)
// and `static uint16_t one(Elem)`.
template <class Cvt, class Elem>
void bf16p_pack_pair(const Elem* r0, const Elem* r1, int64_t k, uint16_t* dst,
                     int64_t slice_stride) {
  const int64_t kp = bf16p_padded_k(k);
  int64_t k0 = 0;
  if (r0 != nullptr) {  // r1 == nullptr: the padding row of an odd m or n, zeros
    const uint64x2_t zero = vdupq_n_u64(0);
    for (; k0 + 8 <= k; k0 += 8, dst += 2 * slice_stride) {
      const uint64x2_t a = vreinterpretq_u64_u16(Cvt::eight(r0 + k0));
      const uint64x2_t b = r1 != nullptr ? vreinterpretq_u64_u16(Cvt::eight(r1 + k0)) : zero;
      vst1q_u16(dst, vreinterpretq_u16_u64(vzip1q_u64(a, b)));
      vst1q_u16(dst + slice_stride, vreinterpretq_u16_u64(vzip2q_u64(a, b)));
    }
  }
  for (; k0 < kp; k0 += 4, dst += slice_stride) {
    for (int x = 0; x < 4; ++x) {
      const int64_t kk = k0 + x;
      dst[x] = r0 != nullptr && kk < k ? Cvt::one(r0[kk]) : 0;
      dst[4 + x] = r1 != nullptr && kk < k ? Cvt::one(r1[kk]) : 0;
    }
  }
}

// int8 -> bf16 bits (the Cvt of the int8 packers), exact: the fp32 of a small integer has a zero low half. eight(): 8 at a
// time (uzp2 takes the high halves of the fp32 values).
struct FromInt8 {
  static uint16x8_t eight(const int8_t* p) {
    const int16x8_t w = vmovl_s8(vld1_s8(p));
    const float32x4_t lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
    const float32x4_t hi = vcvtq_f32_s32(vmovl_high_s16(w));
    return vuzp2q_u16(vreinterpretq_u16_f32(lo), vreinterpretq_u16_f32(hi));
  }
  static uint16_t one(int8_t v) {
    const float f = float(v);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return uint16_t(u >> 16);
  }
};

// A (bf16p2x4) from m row pointers.
template <class Cvt, class Elem>
void bf16p2x4_pack(int64_t m, int64_t k, const Elem* const* rows, void* packed) {
  const int64_t kp = bf16p_padded_k(k);
  auto* dst = static_cast<uint16_t*>(packed);
  for (int64_t p = 0; p * 2 < m; ++p)
    bf16p_pack_pair<Cvt>(rows[2 * p], 2 * p + 1 < m ? rows[2 * p + 1] : nullptr, k,
                         dst + p * 2 * kp, 8);
}

// B (bf16cp8x4) from n rows of depth k, row j at rhs + j * stride.
template <class Cvt, class Elem>
void bf16cp8x4_pack(int64_t n, int64_t k, const Elem* rhs, int64_t stride, void* packed) {
  const int64_t kp = bf16p_padded_k(k);
  auto* dst = static_cast<uint16_t*>(packed);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    for (int64_t c = 0; c < 4; ++c) {
      const int64_t j = j0 + 2 * c;
      bf16p_pack_pair<Cvt>(j < n ? rhs + j * stride : nullptr,
                           j + 1 < n ? rhs + (j + 1) * stride : nullptr, k, dst + j0 * kp + 8 * c,
                           32);
    }
  }
}

// The inner loop's loads and BFMMLA as volatile asm statements. GCC keeps volatile asm in program
// order, so the loop below runs in the order it is written (each pair of B column pairs loaded
// right before its uses) and keeps the register pressure written there: at most 24 accumulators,
// 3 A and 2 B operands. With plain intrinsics GCC 12 hoists every load of
// an iteration to its top and spills accumulators, and without that scheduling it no longer pairs
// the q loads into ldp.
// The loads take only registers (a memory operand made GCC keep the accumulators in memory too).
// They read packed operands that nothing writes while a tile runs, and each tile starts with a
// compiler barrier (a "memory" clobber), so every store before the call is done before they read
// and none after it is moved ahead of them.
inline void bf16_ldp_post(bfloat16x8_t& x, bfloat16x8_t& y, const bfloat16_t*& p) {
  bfloat16x8_t lx, ly;
  const bfloat16_t* lp = p;
  asm volatile("ldp %q0, %q1, [%2], #32" : "=w"(lx), "=w"(ly), "+r"(lp));
  x = lx;
  y = ly;
  p = lp;
}
inline void bf16_ldr_post(bfloat16x8_t& x, const bfloat16_t*& p) {
  bfloat16x8_t lx;
  const bfloat16_t* lp = p;
  asm volatile("ldr %q0, [%1], #16" : "=w"(lx), "+r"(lp));
  x = lx;
  p = lp;
}
inline float32x4_t bf16_mmla(float32x4_t acc, bfloat16x8_t a, bfloat16x8_t b) {
  asm volatile("bfmmla %0.4s, %1.8h, %2.8h" : "+w"(acc) : "w"(a), "w"(b));
  return acc;
}

// One 4-k slice of an NP x NB tile, the A operands loaded: per block, two ldp of two column
// pairs each, every column pair used by the NP row pairs right after its load.
template <int NP, int NB>
__attribute__((always_inline)) inline void bfmmla_slice(float32x4_t (&acc)[NP][4 * NB],
                                                       const bfloat16x8_t (&av)[NP],
                                                       const bfloat16_t* (&bp)[NB]) {
  for (int nb = 0; nb < NB; ++nb)
    for (int c = 0; c < 4; c += 2) {
      bfloat16x8_t b0, b1;
      bf16_ldp_post(b0, b1, bp[nb]);
      for (int p = 0; p < NP; ++p) acc[p][4 * nb + c] = bf16_mmla(acc[p][4 * nb + c], av[p], b0);
      for (int p = 0; p < NP; ++p)
        acc[p][4 * nb + c + 1] = bf16_mmla(acc[p][4 * nb + c + 1], av[p], b1);
    }
}

// NP row pairs x NB column blocks over `steps` slices from zero, into out (fp32). Row pair p of A
// at a + p * pair_stride, block nb of B at b + nb * block_stride (bf16 elements). Two slices per
// iteration: the loop overhead halves, and a row pair's two A slices come in one ldp where the
// registers allow (not at 3 x 2: 24 accumulators + 6 A + 2 B would take all 32). Every pointer
// advances by post-indexing, so an iteration is its loads, its BFMMLA and subs + b.ne. Not
// inlined: the loop is register-allocated on its own, whatever the caller keeps live.
template <int NP, int NB>
__attribute__((noinline)) void bfmmla_tile(const bfloat16_t* a, int64_t pair_stride,
                                           const bfloat16_t* b, int64_t block_stride,
                                           int64_t steps, float32x4_t (&out)[NP][4 * NB]) {
  constexpr bool kPairA = 4 * NP * NB + 2 * NP + 2 < 32;
  asm volatile("" ::: "memory");  // see bf16_ldp_post
  float32x4_t acc[NP][4 * NB];
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < 4 * NB; ++c) acc[p][c] = vdupq_n_f32(0.0f);
  const bfloat16_t* ap[NP];
  const bfloat16_t* bp[NB];
  for (int p = 0; p < NP; ++p) ap[p] = a + p * pair_stride;
  for (int nb = 0; nb < NB; ++nb) bp[nb] = b + nb * block_stride;
  bfloat16x8_t a0[NP], a1[NP];
  if (steps & 1) {  // the odd slice first: the loop then ends the tile
    for (int p = 0; p < NP; ++p) bf16_ldr_post(a0[p], ap[p]);
    bfmmla_slice<NP, NB>(acc, a0, bp);
  }
  for (int64_t s = steps >> 1; s > 0; --s) {
    for (int p = 0; p < NP; ++p) {
      if (kPairA) {
        bf16_ldp_post(a0[p], a1[p], ap[p]);
      } else {
        bf16_ldr_post(a0[p], ap[p]);
      }
    }
    bfmmla_slice<NP, NB>(acc, a0, bp);
    if (!kPairA)
      for (int p = 0; p < NP; ++p) bf16_ldr_post(a1[p], ap[p]);
    bfmmla_slice<NP, NB>(acc, a1, bp);
  }
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < 4 * NB; ++c) out[p][c] = acc[p][c];
}

// Rows 0 and 1 (columns 0-3) of two neighbouring 2x2 blocks [r0c0 r0c1 r1c0 r1c1].
inline float32x4_t bfmmla_row0(float32x4_t x, float32x4_t y) {
  return vreinterpretq_f32_u64(vzip1q_u64(vreinterpretq_u64_f32(x), vreinterpretq_u64_f32(y)));
}
inline float32x4_t bfmmla_row1(float32x4_t x, float32x4_t y) {
  return vreinterpretq_f32_u64(vzip2q_u64(vreinterpretq_u64_f32(x), vreinterpretq_u64_f32(y)));
}
inline int32x4_t bfmmla_row0(int32x4_t x, int32x4_t y) {
  return vreinterpretq_s32_u64(vzip1q_u64(vreinterpretq_u64_s32(x), vreinterpretq_u64_s32(y)));
}
inline int32x4_t bfmmla_row1(int32x4_t x, int32x4_t y) {
  return vreinterpretq_s32_u64(vzip2q_u64(vreinterpretq_u64_s32(x), vreinterpretq_u64_s32(y)));
}

// One NP x NB tile at rows [i0, i0 + rows), columns [j0, j0 + cols): Sum::tile<NP, NB> fills the
// accumulators over the whole K, then each finished row of each 8-column block goes to
// store(i, j, nc, columns 0-3, columns 4-7).
template <class Sum, int NP, int NB, class Store>
inline void bfmmla_tile_and_emit(const bfloat16_t* a, const bfloat16_t* b, int64_t kp, int64_t i0,
                                 int64_t rows, int64_t j0, int64_t cols, const Store& store) {
  typename Sum::Acc acc[NP][4 * NB];
  Sum::template tile<NP, NB>(a, b, kp, acc);
  for (int p = 0; p < NP; ++p)
    for (int nb = 0; nb < NB; ++nb) {
      const auto* q = acc[p] + 4 * nb;
      const int64_t nc = std::min<int64_t>(8, cols - 8 * nb);
      store(i0 + 2 * p, j0 + 8 * nb, nc, bfmmla_row0(q[0], q[1]), bfmmla_row0(q[2], q[3]));
      if (2 * p + 1 < rows)
        store(i0 + 2 * p + 1, j0 + 8 * nb, nc, bfmmla_row1(q[0], q[1]), bfmmla_row1(q[2], q[3]));
    }
}

// The whole m x n problem (m, n >= 0) in tiles chosen as described at the top. Sum: a struct with
// `using Acc` (the accumulator vector type) and
// `template <int NP, int NB> static void tile(a, b, kp, Acc (&acc)[NP][4 * NB])`.
template <class Sum, class Store>
void bfmmla_run(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs,
                const Store& store) {
  const int64_t kp = bf16p_padded_k(k);
  const auto* a = static_cast<const bfloat16_t*>(lhs);
  const auto* b = static_cast<const bfloat16_t*>(rhs);
  // The tile shapes the choice below can produce, by [row pairs][column blocks].
  using Tile = void (*)(const bfloat16_t*, const bfloat16_t*, int64_t, int64_t, int64_t, int64_t,
                        int64_t, const Store&);
  static constexpr Tile kTiles[5][5] = {
      {},
      {nullptr, bfmmla_tile_and_emit<Sum, 1, 1, Store>, bfmmla_tile_and_emit<Sum, 1, 2, Store>,
       bfmmla_tile_and_emit<Sum, 1, 3, Store>, bfmmla_tile_and_emit<Sum, 1, 4, Store>},
      {nullptr, bfmmla_tile_and_emit<Sum, 2, 1, Store>, bfmmla_tile_and_emit<Sum, 2, 2, Store>},
      {nullptr, bfmmla_tile_and_emit<Sum, 3, 1, Store>, bfmmla_tile_and_emit<Sum, 3, 2, Store>},
      {nullptr, bfmmla_tile_and_emit<Sum, 4, 1, Store>},
  };
  const int64_t pairs = (m + 1) / 2, blocks = (n + 7) / 8;
  const int64_t group = pairs == 1 ? 4 : 2;  // column blocks per group
  for (int64_t jb = 0; jb < blocks; jb += group) {
    const int64_t nb = std::min(group, blocks - jb);
    const int64_t j0 = 8 * jb, cols = std::min(8 * nb, n - j0);
    const bfloat16_t* bj = b + j0 * kp;
    const int64_t max_np = nb == 1 ? 4 : 3;
    const int64_t tiles = (pairs + max_np - 1) / max_np;
    for (int64_t t = 0, p0 = 0; t < tiles; ++t) {
      const int64_t np = pairs / tiles + (t < pairs % tiles ? 1 : 0);
      const int64_t i0 = 2 * p0, rows = std::min(2 * np, m - i0);
      const bfloat16_t* ai = a + i0 * kp;
      kTiles[np][nb](ai, bj, kp, i0, rows, j0, cols, store);
      p0 += np;
    }
  }
}

}  // namespace
}  // namespace cpumoe
