// qgemm_qs8p8x8_qs8cp8x8_8x8_neon_i8mm: the int8 GEMM on SMMLA (Armv8.6 FEAT_I8MM).
//
// SMMLA multiplies a 2x8 int8 block of A by an 8x2 block of B^T into a 2x2 int32 block, so both
// operands are packed in 8-k slices of pairs (kp = round_up(k, 8); zeros pad k to kp):
//   A (qs8p8x8):  rows in blocks of 8 (4 row pairs); block b occupies 8 * kp bytes at b * 8 * kp;
//                 its slice s (64 bytes at s * 64) holds the pairs in order, pair p = row 2p
//                 [8s, 8s+8) then row 2p+1 (16 bytes: one q register). The last block is padded
//                 with zero rows, so every block has the same slice stride and a call may start
//                 at any block and stop at any row.
//   B (qs8cp8x8): block b of 8 output columns occupies 8 * kp bytes at b * 8 * kp; slice s holds
//                 the four column pairs (64 bytes: four q registers), pair c = columns 2c, 2c+1.
// Either operand's slice is one `ld1 {4 x 16b}, [x], #64`; a tile of np < 4 row pairs loads only
// its np registers (`ld1 {np x 16b}, [x], x64`).
//
// Register tiles: NP row pairs x NB column blocks, one int32x4 accumulator per (row pair, column
// pair), 4 * NP * NB in all (up to 24, in v8-v31), the whole K in registers, in inline asm: GCC
// keeps part of an accumulator array in memory and adds a pointer update per load, while the asm
// loop is exactly the loads, the SMMLA and one subs/b.ne per 8 slices. The B registers (v4-v7) are
// reloaded for each block of a tile, so a tile can be as wide as its accumulators allow. Per 8-k
// slice:
//   tile (NP x NB)  rows  accumulators  instructions per SMMLA: (loads + SMMLA + loop / 8) / SMMLA
//   4 x 1 (8x8)     7-8   16            (2 + 16 + 0.25) / 16 = 1.14
//   3 x 2 (6x16)    5-6   24            (3 + 24 + 0.25) / 24 = 1.14
//   2 x 3 (4x24)    3-4   24            (4 + 24 + 0.25) / 24 = 1.18
//   1 x 6 (2x48)    1-2   24            (7 + 24 + 0.25) / 24 = 1.30   decode: each B byte once
// (3x1, 2x2, 2x1, 1x3, 1x2, 1x1 only in the last column blocks of a call.) SMMLA's latency is 3
// cycles and V1/V2 issue 4 per cycle, N2 2: 12 independent chains fill V1/V2, 6 fill N2, and every
// main tile has 16 or 24. llvm-mca (tests_cpp/bench/mca/) models the 4x1, 3x2 and 2x3 loops at the
// SMMLA peak on Neoverse V1, V2 and N2 (4.0 / 4.0 / 8.0 cycles per slice for 16 SMMLA); the 1x6
// decode loop is bound by its loads on V1/V2 (16 bytes of weights per SMMLA: 8.3 cycles per slice
// for 24 SMMLA, 72% of the SMMLA peak) and at the peak on N2.
// After the loop the asm stores the accumulators to a small array (st1, 64 bytes per 4); one ld2
// per 4 columns then separates the two rows of a pair for the epilogue, which loads a block's
// column scales and bias once for all its rows.
//
// Walk: column steps of 6 blocks (48 columns) outer, row tiles inner, so a step's packed B stays
// in L1/L2 while the row tiles pass; for m <= 8 (one row tile: decode and most experts at
// T <= 128) each weight byte is read exactly once per call. Each output element is the sum of its
// slices in order in one accumulator whatever the tile, so results do not depend on the tiling.
// @pre m, n >= 0, k >= 1; packed buffers from this kernel's packers.
// Features used: NEON, I8MM.
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_MATMUL_INT8)
#error "qgemm_qs8p8x8_qs8cp8x8_8x8_neon_i8mm.cpp needs -march=armv8.2-a+i8mm (set per file by CMake)"
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
constexpr int64_t kSlice = 64;     // bytes of one 8-k slice of an A block or a B block
constexpr int64_t kStepBlocks = 6; // column blocks per step of the walk

inline int64_t padded_k(int64_t k) { return round_up(k, kKr); }

size_t lhs_size(int64_t m, int64_t k) { return size_t(round_up(m, kMr)) * size_t(padded_k(k)); }
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

// One row pair (r1 may be nullptr: a zero row) into its 16 bytes of every slice of a block at dst.
void pack_pair(const int8_t* r0, const int8_t* r1, int64_t k, int64_t kp, int8_t* dst) {
  int64_t k0 = 0;
  // Two slices per step: 16 bytes of each row, zipped by 8 into the two slices' pair entries.
  const int64x2_t z = vdupq_n_s64(0);
  for (; k0 + 16 <= k; k0 += 16, dst += 2 * kSlice) {
    const int64x2_t a = vreinterpretq_s64_s8(vld1q_s8(r0 + k0));
    const int64x2_t b = r1 != nullptr ? vreinterpretq_s64_s8(vld1q_s8(r1 + k0)) : z;
    vst1q_s8(dst, vreinterpretq_s8_s64(vzip1q_s64(a, b)));
    vst1q_s8(dst + kSlice, vreinterpretq_s8_s64(vzip2q_s64(a, b)));
  }
  for (; k0 < kp; k0 += 8, dst += kSlice) {
    copy_slice(dst, r0, k0, k);
    copy_slice(dst + 8, r1, k0, k);
  }
}

// Zeroes pairs [np, 4) of every slice of a block (the padding of the last block).
void zero_pairs(int64_t np, int64_t kp, int8_t* dst) {
  const int8x16_t z = vdupq_n_s8(0);
  for (int8_t* d = dst + np * 16; d < dst + kp * 8; d += kSlice) {
    vst1q_s8(d, z);
    if (np < 3) vst1q_s8(d + 16, z);
    if (np < 2) vst1q_s8(d + 32, z);
  }
}

void pack_lhs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  const int64_t kp = padded_k(k);
  auto* dst = static_cast<int8_t*>(packed);
  for (int64_t b0 = 0; b0 < m; b0 += kMr) {
    const int64_t np = std::min<int64_t>(kMr / 2, (m - b0 + 1) / 2);
    for (int64_t p = 0; p < np; ++p) {
      const int64_t i = b0 + 2 * p;
      pack_pair(rows[i], i + 1 < m ? rows[i + 1] : nullptr, k, kp, dst + b0 * kp + p * 16);
    }
    if (np < kMr / 2) zero_pairs(np, kp, dst + b0 * kp);
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

// --- The inner loops ---------------------------------------------------------------------------
// Registers: the A slice in v0..v3 (NP of them, one ld1), each B block's slice in v4-v7 (one ld1
// per block, reused for every block of the tile: renaming makes the reuse free), and the
// accumulators in v8-v31, 4 per (row pair p, block j): group g = p * NB + j is v(8+4g)..v(11+4g),
// column pairs 0-3. B blocks are 8 * kp bytes apart: the loads of blocks 0..NB-2 post-index by
// bs = 8 * kp, the last one by back = 64 - (NB - 1) * 8 * kp, so one pointer walks them all. The
// asm zeroes the accumulators, runs the loop and stores them (st1, 64 bytes per group) to an int32
// array: GCC takes at most 30 asm operands, so 24 accumulators cannot be operands.
#define CPUMOE_MMB(a, r0, r1, r2, r3)                                                        \
  "smmla " r0 ".4s, " a ".16b, v4.16b\n\tsmmla " r1 ".4s, " a ".16b, v5.16b\n\tsmmla " r2 \
  ".4s, " a ".16b, v6.16b\n\tsmmla " r3 ".4s, " a ".16b, v7.16b\n\t"
#define CPUMOE_MM(a, ...) CPUMOE_MMB(a, __VA_ARGS__)
#define CPUMOE_G0 "v8", "v9", "v10", "v11"
#define CPUMOE_G1 "v12", "v13", "v14", "v15"
#define CPUMOE_G2 "v16", "v17", "v18", "v19"
#define CPUMOE_G3 "v20", "v21", "v22", "v23"
#define CPUMOE_G4 "v24", "v25", "v26", "v27"
#define CPUMOE_G5 "v28", "v29", "v30", "v31"
#define CPUMOE_LDB_NEXT "ld1 {v4.16b-v7.16b}, [%[b]], %[bs]\n\t"
#define CPUMOE_LDB_LAST "ld1 {v4.16b-v7.16b}, [%[b]], %[back]\n\t"
#define CPUMOE_LDA1 "ld1 {v0.16b}, [%[a]], %[as]\n\t"
#define CPUMOE_LDA2 "ld1 {v0.16b-v1.16b}, [%[a]], %[as]\n\t"
#define CPUMOE_LDA3 "ld1 {v0.16b-v2.16b}, [%[a]], %[as]\n\t"
#define CPUMOE_LDA4 "ld1 {v0.16b-v3.16b}, [%[a]], %[as]\n\t"
// One 8-k slice of each tile shape NPxNB.
#define CPUMOE_STEP_4x1                                                                  \
  CPUMOE_LDA4 CPUMOE_LDB_LAST CPUMOE_MM("v0", CPUMOE_G0) CPUMOE_MM("v1", CPUMOE_G1)      \
      CPUMOE_MM("v2", CPUMOE_G2) CPUMOE_MM("v3", CPUMOE_G3)
#define CPUMOE_STEP_3x2                                                                  \
  CPUMOE_LDA3 CPUMOE_LDB_NEXT CPUMOE_MM("v0", CPUMOE_G0) CPUMOE_MM("v1", CPUMOE_G2)      \
      CPUMOE_MM("v2", CPUMOE_G4) CPUMOE_LDB_LAST CPUMOE_MM("v0", CPUMOE_G1)              \
          CPUMOE_MM("v1", CPUMOE_G3) CPUMOE_MM("v2", CPUMOE_G5)
#define CPUMOE_STEP_3x1                                                                  \
  CPUMOE_LDA3 CPUMOE_LDB_LAST CPUMOE_MM("v0", CPUMOE_G0) CPUMOE_MM("v1", CPUMOE_G1)      \
      CPUMOE_MM("v2", CPUMOE_G2)
#define CPUMOE_STEP_2x3                                                                  \
  CPUMOE_LDA2 CPUMOE_LDB_NEXT CPUMOE_MM("v0", CPUMOE_G0) CPUMOE_MM("v1", CPUMOE_G3)      \
      CPUMOE_LDB_NEXT CPUMOE_MM("v0", CPUMOE_G1) CPUMOE_MM("v1", CPUMOE_G4)              \
          CPUMOE_LDB_LAST CPUMOE_MM("v0", CPUMOE_G2) CPUMOE_MM("v1", CPUMOE_G5)
#define CPUMOE_STEP_2x2                                                                  \
  CPUMOE_LDA2 CPUMOE_LDB_NEXT CPUMOE_MM("v0", CPUMOE_G0) CPUMOE_MM("v1", CPUMOE_G2)      \
      CPUMOE_LDB_LAST CPUMOE_MM("v0", CPUMOE_G1) CPUMOE_MM("v1", CPUMOE_G3)
#define CPUMOE_STEP_2x1 \
  CPUMOE_LDA2 CPUMOE_LDB_LAST CPUMOE_MM("v0", CPUMOE_G0) CPUMOE_MM("v1", CPUMOE_G1)
#define CPUMOE_STEP_1x6                                                                  \
  CPUMOE_LDA1 CPUMOE_LDB_NEXT CPUMOE_MM("v0", CPUMOE_G0) CPUMOE_LDB_NEXT                 \
      CPUMOE_MM("v0", CPUMOE_G1) CPUMOE_LDB_NEXT CPUMOE_MM("v0", CPUMOE_G2)              \
          CPUMOE_LDB_NEXT CPUMOE_MM("v0", CPUMOE_G3) CPUMOE_LDB_NEXT                     \
              CPUMOE_MM("v0", CPUMOE_G4) CPUMOE_LDB_LAST CPUMOE_MM("v0", CPUMOE_G5)
#define CPUMOE_STEP_1x3                                                                  \
  CPUMOE_LDA1 CPUMOE_LDB_NEXT CPUMOE_MM("v0", CPUMOE_G0) CPUMOE_LDB_NEXT                 \
      CPUMOE_MM("v0", CPUMOE_G1) CPUMOE_LDB_LAST CPUMOE_MM("v0", CPUMOE_G2)
#define CPUMOE_STEP_1x2 \
  CPUMOE_LDA1 CPUMOE_LDB_NEXT CPUMOE_MM("v0", CPUMOE_G0) CPUMOE_LDB_LAST CPUMOE_MM("v0", CPUMOE_G1)
#define CPUMOE_STEP_1x1 CPUMOE_LDA1 CPUMOE_LDB_LAST CPUMOE_MM("v0", CPUMOE_G0)
// Zeroing (one ld1 of 64 zero bytes per group: a quarter of the instructions of movi) and storing
// the first n groups.
#define CPUMOE_Z1 "ld1 {v8.4s-v11.4s}, [%[z]]\n\t"
#define CPUMOE_Z2 CPUMOE_Z1 "ld1 {v12.4s-v15.4s}, [%[z]]\n\t"
#define CPUMOE_Z3 CPUMOE_Z2 "ld1 {v16.4s-v19.4s}, [%[z]]\n\t"
#define CPUMOE_Z4 CPUMOE_Z3 "ld1 {v20.4s-v23.4s}, [%[z]]\n\t"
#define CPUMOE_Z6 CPUMOE_Z4 "ld1 {v24.4s-v27.4s}, [%[z]]\n\tld1 {v28.4s-v31.4s}, [%[z]]\n\t"
#define CPUMOE_S1 "st1 {v8.4s-v11.4s}, [%[o]], #64\n\t"
#define CPUMOE_S2 CPUMOE_S1 "st1 {v12.4s-v15.4s}, [%[o]], #64\n\t"
#define CPUMOE_S3 CPUMOE_S2 "st1 {v16.4s-v19.4s}, [%[o]], #64\n\t"
#define CPUMOE_S4 CPUMOE_S3 "st1 {v20.4s-v23.4s}, [%[o]], #64\n\t"
#define CPUMOE_S6 CPUMOE_S4 "st1 {v24.4s-v27.4s}, [%[o]], #64\n\tst1 {v28.4s-v31.4s}, [%[o]], #64\n\t"
// The loop: `n8` groups of 8 slices, then `r` single slices.
#define CPUMOE_LOOP(STEP)                                                      \
  "cbz %[n8], 2f\n"                                                            \
  "1:\n\t" STEP STEP STEP STEP STEP STEP STEP STEP "subs %[n8], %[n8], #1\n\t" \
  "b.ne 1b\n"                                                                  \
  "2:\n\t"                                                                     \
  "cbz %[r], 4f\n"                                                             \
  "3:\n\t" STEP "subs %[r], %[r], #1\n\t"                                      \
  "b.ne 3b\n"                                                                  \
  "4:\n\t"
#define CPUMOE_TILE_ASM(Z, STEP, S)                                                              \
  __asm__ volatile(Z CPUMOE_LOOP(STEP) S                                                          \
                   : [a] "+r"(a), [b] "+r"(b), [n8] "+r"(n8), [r] "+r"(r), [o] "+r"(o)            \
                   : [as] "r"(as), [bs] "r"(bs), [back] "r"(back), [z] "r"(kZeros)                \
                   : "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11",    \
                     "v12", "v13", "v14", "v15", "v16", "v17", "v18", "v19", "v20", "v21", "v22", \
                     "v23", "v24", "v25", "v26", "v27", "v28", "v29", "v30", "v31", "cc", "memory")

// NP row pairs x NB column blocks over the whole depth; writes the 4 * NP * NB accumulators to
// acc (group g = p * NB + j at acc + 16 g: column pairs 0-3, each [r0c0 r0c1 r1c0 r1c1]).
// a: the row tile's first slice; b: block 0 of the tile; blocks 8 * kp bytes apart.
alignas(64) constexpr int32_t kZeros[16] = {};

template <int NP, int NB>
__attribute__((always_inline)) inline void tile(const int8_t* a, const int8_t* b, int64_t kp,
                                                int32_t* acc) {
  const uint64_t steps = uint64_t(kp) / 8;
  uint64_t n8 = steps / 8, r = steps % 8;
  int32_t* o = acc;
  const int64_t as = kSlice, bs = kNr * kp, back = kSlice - (NB - 1) * kNr * kp;
  if constexpr (NP == 4 && NB == 1) CPUMOE_TILE_ASM(CPUMOE_Z4, CPUMOE_STEP_4x1, CPUMOE_S4);
  else if constexpr (NP == 3 && NB == 2) CPUMOE_TILE_ASM(CPUMOE_Z6, CPUMOE_STEP_3x2, CPUMOE_S6);
  else if constexpr (NP == 3 && NB == 1) CPUMOE_TILE_ASM(CPUMOE_Z3, CPUMOE_STEP_3x1, CPUMOE_S3);
  else if constexpr (NP == 2 && NB == 3) CPUMOE_TILE_ASM(CPUMOE_Z6, CPUMOE_STEP_2x3, CPUMOE_S6);
  else if constexpr (NP == 2 && NB == 2) CPUMOE_TILE_ASM(CPUMOE_Z4, CPUMOE_STEP_2x2, CPUMOE_S4);
  else if constexpr (NP == 2 && NB == 1) CPUMOE_TILE_ASM(CPUMOE_Z2, CPUMOE_STEP_2x1, CPUMOE_S2);
  else if constexpr (NP == 1 && NB == 6) CPUMOE_TILE_ASM(CPUMOE_Z6, CPUMOE_STEP_1x6, CPUMOE_S6);
  else if constexpr (NP == 1 && NB == 3) CPUMOE_TILE_ASM(CPUMOE_Z3, CPUMOE_STEP_1x3, CPUMOE_S3);
  else if constexpr (NP == 1 && NB == 2) CPUMOE_TILE_ASM(CPUMOE_Z2, CPUMOE_STEP_1x2, CPUMOE_S2);
  else {
    static_assert(NP == 1 && NB == 1, "no such tile");
    CPUMOE_TILE_ASM(CPUMOE_Z1, CPUMOE_STEP_1x1, CPUMOE_S1);
  }
}

// The stores of a tile's accumulators (acc as tile() leaves them) into rows i0.. and blocks
// jb.. of the output. Row 2p of block j is the low halves of group p * NB + j's column pairs, row
// 2p + 1 the high halves: one ld2 (64-bit lanes) per four columns separates them. A full block (8
// columns) loads what its rows share (column scales, bias) once; a partial one (the last block of
// a call) goes through the scalar tail stores of qgemm_neon_common.h, out of line. Everything is
// copied into locals first, so the compiler keeps it in registers across the stores.
template <int NP, int NB, class Out>
inline void store_tile(const Out& out, const int32_t* acc, int64_t rows, int64_t jb, int64_t n) {
  // Rows 2p and 2p + 1 of block j: f(i, lo, hi) for each existing row.
  auto pair = [&](int p, int j, const auto& f) {
    const auto* g = reinterpret_cast<const int64_t*>(acc + 16 * (p * NB + j));
    const int64x2x2_t lo = vld2q_s64(g);      // column pairs 0, 1: row 2p | row 2p + 1
    const int64x2x2_t hi = vld2q_s64(g + 4);  // column pairs 2, 3
    f(2 * p, vreinterpretq_s32_s64(lo.val[0]), vreinterpretq_s32_s64(hi.val[0]));
    if (2 * p + 1 < rows)
      f(2 * p + 1, vreinterpretq_s32_s64(lo.val[1]), vreinterpretq_s32_s64(hi.val[1]));
  };
  if (n - jb * kNr >= NB * kNr) {  // every block full: the common case
    for (int j = 0; j < NB; ++j) {
      const int64_t j0 = (jb + j) * kNr;
      const typename Out::Cols cols = out.cols(j0);
      for (int p = 0; p < NP; ++p)
        pair(p, j, [&](int64_t i, int32x4_t lo, int32x4_t hi) { out.row(cols, i, j0, lo, hi); });
    }
    return;
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t j0 = (jb + j) * kNr;
    if (j0 >= n) return;
    const int64_t nc = std::min(kNr, n - j0);
    for (int p = 0; p < NP; ++p)
      pair(p, j, [&](int64_t i, int32x4_t lo, int32x4_t hi) { out.tail(i, j0, nc, lo, hi); });
  }
}

__attribute__((noinline)) void tail_s32(int32_t* d, int32x4_t lo, int32x4_t hi, int64_t nc) {
  neon_store_s32(d, lo, hi, nc);
}
__attribute__((noinline)) void tail_f32(float* d, int32x4_t lo, int32x4_t hi, int64_t nc, float ls,
                                        const float* rs, const float* bias) {
  neon_store_f32(d, lo, hi, nc, ls, rs, bias);
}

// The outputs of a call from row i0 on. cols(j0) loads what the rows of a full block share; row()
// stores one full row of a block, tail() a row of a partial block.
struct S32Out {
  int32_t* d;  // row i0
  int64_t stride;
  struct Cols {};
  Cols cols(int64_t) const { return {}; }
  void row(Cols, int64_t i, int64_t j0, int32x4_t lo, int32x4_t hi) const {
    vst1q_s32(d + i * stride + j0, lo);
    vst1q_s32(d + i * stride + j0 + 4, hi);
  }
  void tail(int64_t i, int64_t j0, int64_t nc, int32x4_t lo, int32x4_t hi) const {
    tail_s32(d + i * stride + j0, lo, hi, nc);
  }
  S32Out at_row(int64_t i0) const { return {d + i0 * stride, stride}; }
};

template <bool kBias>
struct F32Out {
  float* d;         // row i0
  int64_t stride;
  const float* ls;  // lhs_scale of row i0
  const float* rs;
  const float* bias;
  struct Cols {
    float32x4_t s0, s1, b0, b1;
  };
  Cols cols(int64_t j0) const {
    Cols c{vld1q_f32(rs + j0), vld1q_f32(rs + j0 + 4), {}, {}};
    if constexpr (kBias) {
      c.b0 = vld1q_f32(bias + j0);
      c.b1 = vld1q_f32(bias + j0 + 4);
    }
    return c;
  }
  // (acc * lhs_scale) * rhs_scale + bias, as every path computes it.
  void row(const Cols& c, int64_t i, int64_t j0, int32x4_t lo, int32x4_t hi) const {
    const float32x4_t s = vld1q_dup_f32(ls + i);
    float32x4_t f0 = vmulq_f32(vmulq_f32(vcvtq_f32_s32(lo), s), c.s0);
    float32x4_t f1 = vmulq_f32(vmulq_f32(vcvtq_f32_s32(hi), s), c.s1);
    if constexpr (kBias) {
      f0 = vaddq_f32(f0, c.b0);
      f1 = vaddq_f32(f1, c.b1);
    }
    vst1q_f32(d + i * stride + j0, f0);
    vst1q_f32(d + i * stride + j0 + 4, f1);
  }
  void tail(int64_t i, int64_t j0, int64_t nc, int32x4_t lo, int32x4_t hi) const {
    tail_f32(d + i * stride + j0, lo, hi, nc, ls[i], rs + j0, kBias ? bias + j0 : nullptr);
  }
  F32Out at_row(int64_t i0) const { return {d + i0 * stride, stride, ls + i0, rs, bias}; }
};

// One NP x NB tile at row i0, first block jb, stored through out.
template <int NP, int NB, class Out>
inline void run_tile(const int8_t* a, const int8_t* b, int64_t kp, int64_t i0, int64_t rows,
                     int64_t jb, int64_t n, const Out& out) {
  alignas(64) int32_t acc[16 * NP * NB];
  tile<NP, NB>(a + i0 * kp, b + jb * kNr * kp, kp, acc);
  store_tile<NP, NB>(out.at_row(i0), acc, rows, jb, n);
}

// Blocks [jb, jb + nb) of a row tile of NP pairs: tiles of NB blocks, then the rest in the next
// smaller shape (6, 3, 2, 1).
template <int NP, int NB, class Out>
inline void run_blocks(const int8_t* a, const int8_t* b, int64_t kp, int64_t i0, int64_t rows,
                       int64_t jb, int64_t nb, int64_t n, const Out& out) {
  for (; nb >= NB; nb -= NB, jb += NB) run_tile<NP, NB>(a, b, kp, i0, rows, jb, n, out);
  constexpr int kNext = NB == 6 ? 3 : NB - 1;
  if constexpr (kNext > 0) {
    if (nb > 0) run_blocks<NP, kNext>(a, b, kp, i0, rows, jb, nb, n, out);
  }
}

template <class Out>
void run(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, const Out& out) {
  const int64_t kp = padded_k(k);
  const auto* a = static_cast<const int8_t*>(lhs);
  const auto* b = static_cast<const int8_t*>(rhs);
  const int64_t blocks = (n + kNr - 1) / kNr;
  for (int64_t jb = 0; jb < blocks; jb += kStepBlocks) {
    const int64_t nb = std::min(kStepBlocks, blocks - jb);
    for (int64_t i0 = 0; i0 < m; i0 += kMr) {
      const int64_t rows = std::min(kMr, m - i0);
      switch ((rows + 1) / 2) {
        case 4: run_blocks<4, 1>(a, b, kp, i0, rows, jb, nb, n, out); break;
        case 3: run_blocks<3, 2>(a, b, kp, i0, rows, jb, nb, n, out); break;
        case 2: run_blocks<2, 3>(a, b, kp, i0, rows, jb, nb, n, out); break;
        default: run_blocks<1, 6>(a, b, kp, i0, rows, jb, nb, n, out); break;
      }
    }
  }
}

void run_s32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, int32_t* dst,
             int64_t dst_stride) {
  run(m, n, k, lhs, rhs, S32Out{dst, dst_stride});
}

void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  if (ep.bias != nullptr)
    return run(m, n, k, lhs, rhs, F32Out<true>{dst, dst_stride, ep.lhs_scale, ep.rhs_scale, ep.bias});
  run(m, n, k, lhs, rhs, F32Out<false>{dst, dst_stride, ep.lhs_scale, ep.rhs_scale, nullptr});
}

}  // namespace

extern const QGemmUkernel qgemm_qs8p8x8_qs8cp8x8_8x8_neon_i8mm = {
    "qgemm_qs8p8x8_qs8cp8x8_8x8_neon_i8mm",
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
