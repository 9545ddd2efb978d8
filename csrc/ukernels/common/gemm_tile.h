// The register-tile driver shared by the x86 GEMM kernels whose B is packed in blocks of nr output
// columns, one vector per k group of a block, and whose A rows are read one k group at a time and
// broadcast to every lane: the int8 AVX-512 VNNI and AVX2 kernels and the bf16 AVX-512 BF16 and
// AVX2 kernels. Only the arithmetic differs between them; it comes in as an Ops class:
//
//   struct Ops {
//     using Acc = ...;                        // one accumulator vector (one row x one block)
//     static constexpr int64_t kNr;           // output columns of one block (lanes of Acc)
//     static constexpr int kSteps;            // 1 or 2 sub-steps per k group (see load_a/load_b)
//     static constexpr int64_t kAGroupBytes;  // bytes of one A row per k group
//     static constexpr int64_t kBGroupBytes;  // bytes of one B block per k group
//     static constexpr int kSmallRows, kSmallBlocks;  // the tile for m <= kSmallRows
//     static constexpr int kRows, kBlocks;            // the tile for larger m
//     static constexpr bool kDecodePrefetch;  // optional (default false): see run()
//     static Acc zero();
//     template <int S> static AVec load_a(const uint8_t* p);  // sub-step S of the group at p
//     template <int S> static BVec load_b(const uint8_t* p);
//     static Acc dot(Acc c, const AVec& a, const BVec& b);     // c += a . b
//     static Acc finish(Acc c, const uint8_t* block_end);      // after the whole depth
//   };
//
// A sub-step is a share of a group with its own A and B vectors (the AVX2 bf16 kernel widens a
// pair of k into an even and an odd vector, one after the other, to keep within 16 registers).
// finish sees the first byte after the block's groups (the VNNI kernel keeps its column sums
// there). A tile is MR rows x NB blocks (MR <= 8, NB <= 4) over the whole depth, its accumulators
// in registers; a store functor gets each finished row of a block, store(i, j0, nc, acc), with
// nc <= kNr real columns. The walk goes over column steps of kBlocks (or kSmallBlocks) blocks,
// the row tiles (the rows split evenly) inner, so a step's weights stay in L1/L2 while the row tiles pass; decode (one
// row per expert) reads each weight once.
//
// pack_rhs_groups packs B into that layout. No intrinsics here. Internal linkage on purpose (see
// qgemm_common.h): each kernel file instantiates the templates with its own ISA flags.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace cpumoe {
namespace {
namespace gemm_tile {

/// The 4 bytes at p as one int32 (an A group to broadcast).
inline int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The accumulators are named variables, not an array: GCC keeps an array of vectors partly in
// memory (a store per multiply-add), named ones stay in registers; the `if constexpr` guards drop
// the ones a tile does not use.
#define CPUMOE_TILE_ACC_DECL(i) \
  Acc c##i##0 = Ops::zero(), c##i##1 = c##i##0, c##i##2 = c##i##0, c##i##3 = c##i##0;
#define CPUMOE_TILE_ACC_ROW(i, S)                                                  \
  if constexpr (MR > i) {                                                          \
    const auto av = Ops::template load_a<S>(a + i * lda + Ops::kAGroupBytes * g); \
    c##i##0 = Ops::dot(c##i##0, av, b0);                                           \
    if constexpr (NB > 1) c##i##1 = Ops::dot(c##i##1, av, b1);                     \
    if constexpr (NB > 2) c##i##2 = Ops::dot(c##i##2, av, b2);                     \
    if constexpr (NB > 3) c##i##3 = Ops::dot(c##i##3, av, b3);                     \
  }
#define CPUMOE_TILE_STEP(S)                                                                   \
  {                                                                                           \
    const uint8_t* bg = b + Ops::kBGroupBytes * g;                                            \
    auto b0 = Ops::template load_b<S>(bg), b1 = b0, b2 = b0, b3 = b0;                         \
    if constexpr (NB > 1) b1 = Ops::template load_b<S>(bg + bstride);                         \
    if constexpr (NB > 2) b2 = Ops::template load_b<S>(bg + 2 * bstride);                     \
    if constexpr (NB > 3) b3 = Ops::template load_b<S>(bg + 3 * bstride);                     \
    CPUMOE_TILE_ACC_ROW(0, S) CPUMOE_TILE_ACC_ROW(1, S) CPUMOE_TILE_ACC_ROW(2, S)             \
    CPUMOE_TILE_ACC_ROW(3, S) CPUMOE_TILE_ACC_ROW(4, S) CPUMOE_TILE_ACC_ROW(5, S)             \
    CPUMOE_TILE_ACC_ROW(6, S) CPUMOE_TILE_ACC_ROW(7, S)                                       \
  }
#define CPUMOE_TILE_ACC_SPILL(i)                               \
  if constexpr (MR > i) {                                      \
    buf[i * NB] = c##i##0;                                     \
    if constexpr (NB > 1) buf[i * NB + 1] = c##i##1;           \
    if constexpr (NB > 2) buf[i * NB + 2] = c##i##2;           \
    if constexpr (NB > 3) buf[i * NB + 3] = c##i##3;           \
  }

/// Rows [i0, i0 + MR) x columns [j0, j0 + kNr * NB) (clipped to n) over @p groups k groups: A row
/// i at a + i * lda, B block j at b + j * bstride (bytes). Meanwhile the same lines of the
/// @p pf_blocks blocks at pf (stride bstride) are prefetched.
template <class Ops, int MR, int NB, class Store>
inline void tile_store(int64_t i0, int64_t j0, int64_t n, const uint8_t* a, int64_t lda,
                       const uint8_t* b, int64_t bstride, int64_t groups, const Store& store,
                       const uint8_t* pf, int64_t pf_blocks) {
  static_assert(MR >= 1 && MR <= 8 && NB >= 1 && NB <= 4, "tile too large");
  static_assert(Ops::kSteps == 1 || Ops::kSteps == 2, "one or two sub-steps per group");
  using Acc = typename Ops::Acc;
  CPUMOE_TILE_ACC_DECL(0) CPUMOE_TILE_ACC_DECL(1) CPUMOE_TILE_ACC_DECL(2) CPUMOE_TILE_ACC_DECL(3)
  CPUMOE_TILE_ACC_DECL(4) CPUMOE_TILE_ACC_DECL(5) CPUMOE_TILE_ACC_DECL(6) CPUMOE_TILE_ACC_DECL(7)
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t j = 0; j < pf_blocks; ++j)  // one line per block and group (see run)
      __builtin_prefetch(pf + j * bstride + Ops::kBGroupBytes * g, 0, 2);
    CPUMOE_TILE_STEP(0)
    if constexpr (Ops::kSteps > 1) CPUMOE_TILE_STEP(1)
  }
  // Through L1 to the epilogue: with the epilogue reading the registers directly, GCC 12 keeps a
  // stack copy of every accumulator updated inside the loop.
  Acc buf[MR * NB];
  CPUMOE_TILE_ACC_SPILL(0) CPUMOE_TILE_ACC_SPILL(1) CPUMOE_TILE_ACC_SPILL(2)
  CPUMOE_TILE_ACC_SPILL(3) CPUMOE_TILE_ACC_SPILL(4) CPUMOE_TILE_ACC_SPILL(5)
  CPUMOE_TILE_ACC_SPILL(6) CPUMOE_TILE_ACC_SPILL(7)
  for (int j = 0; j < NB; ++j) {
    const uint8_t* block_end = b + j * bstride + Ops::kBGroupBytes * groups;
    const int64_t c0 = j0 + Ops::kNr * j;
    const int64_t nc = std::min<int64_t>(Ops::kNr, n - c0);
    for (int i = 0; i < MR; ++i) store(i0 + i, c0, nc, Ops::finish(buf[i * NB + j], block_end));
  }
}
#undef CPUMOE_TILE_ACC_DECL
#undef CPUMOE_TILE_ACC_ROW
#undef CPUMOE_TILE_STEP
#undef CPUMOE_TILE_ACC_SPILL

/// Whether the walk below uses an MR x NB tile.
template <class Ops>
constexpr bool tile_used(int mr, int nb) {
  return (mr <= Ops::kSmallRows && nb <= Ops::kSmallBlocks) ||
         (mr <= Ops::kRows && nb <= Ops::kBlocks);
}

template <class Ops, int MR, class Store>
inline void blocks_dispatch(int64_t nb, int64_t i0, int64_t j0, int64_t n, const uint8_t* a,
                            int64_t lda, const uint8_t* b, int64_t bstride, int64_t groups,
                            const Store& s, const uint8_t* pf, int64_t pf_blocks) {
#define CPUMOE_TILE_BLOCKS(NB)                                                 \
  case NB:                                                                     \
    if constexpr (tile_used<Ops>(MR, NB))                                      \
      tile_store<Ops, MR, NB>(i0, j0, n, a, lda, b, bstride, groups, s, pf, pf_blocks); \
    break;
  switch (nb) {
    CPUMOE_TILE_BLOCKS(1) CPUMOE_TILE_BLOCKS(2) CPUMOE_TILE_BLOCKS(3) CPUMOE_TILE_BLOCKS(4)
    default: break;  // unreachable: nb <= the step's blocks
  }
#undef CPUMOE_TILE_BLOCKS
}

/// Ops::kDecodePrefetch, false when the Ops does not declare it.
template <class Ops, class = void>
struct DecodePrefetch : std::false_type {};
template <class Ops>
struct DecodePrefetch<Ops, std::void_t<decltype(Ops::kDecodePrefetch)>>
    : std::bool_constant<Ops::kDecodePrefetch> {};

/// C[0, m) x [0, n) over packed A (row i at a + i * lda) and packed B (block j at b + j *
/// bstride), @p groups k groups each.
template <class Ops, class Store>
void run(int64_t m, int64_t n, const uint8_t* a, int64_t lda, const uint8_t* b, int64_t bstride,
         int64_t groups, const Store& store) {
  if (m <= 0 || n <= 0) return;
  const bool small = m <= Ops::kSmallRows;
  const int64_t max_rows = small ? Ops::kSmallRows : Ops::kRows;
  const int64_t step_blocks = small ? Ops::kSmallBlocks : Ops::kBlocks;
  const int64_t blocks = (n + Ops::kNr - 1) / Ops::kNr;
  for (int64_t jb = 0; jb < blocks; jb += step_blocks) {
    const int64_t nb = std::min(step_blocks, blocks - jb);
    const uint8_t* bj = b + jb * bstride;
    const int64_t j0 = jb * Ops::kNr;
    // Rows split evenly over the fewest tiles (9 rows: 5 + 4, not 8 + 1): a tile of one or two
    // rows has too few accumulator chains to hide the multiply-add latency.
    const int64_t tiles = (m + max_rows - 1) / max_rows;
    const int64_t next_nb = std::min(step_blocks, blocks - jb - nb);
    for (int64_t t = 0, i0 = 0; t < tiles; ++t) {
      const int64_t rows = (m - i0 + (tiles - t) - 1) / (tiles - t);
      const uint8_t* ai = a + i0 * lda;
      // The next column step's weights are prefetched (to L2) while this step runs from cache:
      // during the second row tile (the first one streams this step's weights in), or, with one
      // row tile of 2+ rows, during it. Single-row decode streams at memory speed on the AVX-512
      // kernels; the AVX2 ones (16-byte loads, short streams of one column step) read 25-30%
      // faster with the next step prefetched (Zen 5, T = 1): kDecodePrefetch.
      const bool pf_here = tiles > 1 ? t == 1 : (m > 1 || DecodePrefetch<Ops>::value);
      const uint8_t* pf = pf_here && next_nb > 0 ? bj + nb * bstride : nullptr;
      const int64_t pf_blocks = pf != nullptr ? next_nb : 0;
#define CPUMOE_TILE_ROWS(R) \
  case R: blocks_dispatch<Ops, R>(nb, i0, j0, n, ai, lda, bj, bstride, groups, store, pf, pf_blocks); break;
      switch (rows) {
        CPUMOE_TILE_ROWS(1) CPUMOE_TILE_ROWS(2) CPUMOE_TILE_ROWS(3) CPUMOE_TILE_ROWS(4)
        CPUMOE_TILE_ROWS(5) CPUMOE_TILE_ROWS(6) CPUMOE_TILE_ROWS(7) CPUMOE_TILE_ROWS(8)
        default: break;  // unreachable: rows <= max_rows <= 8
      }
#undef CPUMOE_TILE_ROWS
      i0 += rows;
    }
  }
}

/// Packs B [n][k] (row j at rhs + j * stride) into the layout the tiles read: block b of nr
/// columns at dst + b * block_stride elements, kp / G groups of nr * G elements each, group g
/// holding column c's k = G g .. G g + G - 1 at G c .. G c + G - 1. Padding columns and padding k
/// are zero; anything after a block's groups (up to block_stride) is left alone.
/// @pre kp >= k, kp % G == 0.
template <class T, int G>
inline void pack_rhs_groups(int64_t n, int64_t k, int64_t kp, int64_t nr, const T* rhs,
                            int64_t stride, T* dst, int64_t block_stride) {
  const int64_t blocks = (n + nr - 1) / nr;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    T* d = dst + blk * block_stride;
    for (int64_t c = 0; c < nr; ++c) {
      const int64_t j = blk * nr + c;
      const T* src = j < n ? rhs + j * stride : nullptr;
      const int64_t kc = src != nullptr ? k : 0;  // the column's real values
      int64_t x = 0;
      for (; x + G <= kc; x += G) std::memcpy(d + x * nr + G * c, src + x, G * sizeof(T));
      for (; x < kp; x += G)  // the partial last group, padding groups, padding columns
        for (int t = 0; t < G; ++t) d[x * nr + G * c + t] = x + t < kc ? src[x + t] : T(0);
    }
  }
}

}  // namespace gemm_tile
}  // namespace
}  // namespace cpumoe
