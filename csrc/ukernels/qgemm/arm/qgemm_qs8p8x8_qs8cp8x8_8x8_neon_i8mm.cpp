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
// loop is exactly the loads, the SMMLA and one subs/b.ne per 32 slices. The B registers (v4-v7)
// are reloaded for each block of a tile, so a tile can be as wide as its accumulators allow: 16
// to 24 accumulators (4x1, 3x2, 2x3, 1x6 for 8, 6, 4, 2 rows; 6x1, 5x1 for the last 9-12 rows)
// keep SMMLA's latency hidden, and the loads are at the layouts' floor (instruction counts and
// llvm-mca models per tile: docs/kernels.md).
// run_f32 applies the epilogue in the asm, on the accumulators in registers (see "The fp32
// path" below); tiles with a partial block store the accumulators to a small array
// (st1, 64 bytes per 4), and one ld2 per 4 columns separates the two rows of a pair.
//
// Walk: a call of one row tile (m <= 12: decode and most experts) passes over all its columns
// once, so each weight byte is read exactly once per call; more row tiles walk column steps of 6
// blocks (48 columns) outer, row tiles inner, so a step's packed B stays in L1/L2 while the row
// tiles pass. Each output element is the sum of its slices in order in one accumulator whatever
// the tile, so results do not depend on the tiling.
// @pre m, n >= 0, k >= 1; packed buffers from this kernel's packers.
// Features used: NEON, I8MM.
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_MATMUL_INT8)
#error "qgemm_qs8p8x8_qs8cp8x8_8x8_neon_i8mm.cpp needs -march=armv8.2-a+i8mm (set per file by CMake)"
#endif

#include <arm_neon.h>

#include <algorithm>
#include <cstring>

#include "cpumoe/qgemm.h"
#include "ukernels/qgemm/arm/qgemm_neon_common.h"
#include "ukernels/qgemm/arm/qs8p8x8_pack.h"

namespace cpumoe {
namespace {

constexpr int64_t kMr = 8;
// A in blocks of 8 rows (the last padded with zero rows).
using Packing = QGemmPacking<8, 8, 1, 8>;
constexpr int64_t kNr = Packing::kNr;
constexpr int64_t kKr = Packing::kKr;
constexpr int64_t kSlice = 64;     // bytes of one 8-k slice of an A block or a B block
constexpr int64_t kStepBlocks = 6; // column blocks per step of the walk



void pack_lhs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  pack_lhs_qs8p8x8(m, k, Packing::padded_k(k), rows, static_cast<int8_t*>(packed));
}

void pack_rhs(int64_t n, int64_t k, const int8_t* rhs, int64_t stride, void* packed) {
  const int64_t kp = Packing::padded_k(k);
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

// --- The fp32 path: whole row tiles in one asm ------------------------------------------------
// run_f32 hands a row tile and a run of full column tiles (all 8 columns of every block inside n)
// to one asm block that loops over the column tiles and, per tile, zeroes the accumulators, runs
// the k-loop (32 slices per iteration, then 8, then single slices) and applies the epilogue to the
// accumulators in registers:
//   1. scvtf, then * lhs_scale: pair p's accumulators hold [r c, r c+1, r+1 c, r+1 c+1] (r = 2p),
//      so they are multiplied by L_p = [ls_r ls_r ls_r+1 ls_r+1] (one zip1/zip2 per pair);
//   2. per block, * rhs_scale (+ bias): column pair q by [rs_2q rs_2q+1 rs_2q rs_2q+1] (ld1r of 8
//      bytes), the same for the bias;
//   3. per pair and block, `st4 {4 x .d}[0]` stores row r (the low halves of the 4 column pairs:
//      8 columns) and `st4 {...}[1]` row r + 1, post-indexed by the row stride.
// The same operations in the same order as F32Out::row (and the scalar definition): (acc * ls) *
// rs + bias, one rounding each, so the results are bit-identical to the other paths. The last
// row of an odd row count goes to a scratch row (xl, not advanced); its lhs scale is a zero read
// from a padded copy, never past the caller's array. Tiles that hold a partial block (only the
// last block of a call whose n is not a multiple of 8) take the C++ path (run_tile).
//
// Rows 9-12 (5 or 6 pairs: the last two blocks of a call) use one 5x1 / 6x1 tile over both A
// blocks (a second A pointer) instead of a 4x1 tile plus a 1x6 / 2x3 tile: 3 loads per 20 / 24
// SMMLA instead of 3.17 / 3.33 per block-slice, and half the tiles.
#define CPUMOE_STEP_6x1                                                                  \
  CPUMOE_LDA4 CPUMOE_LDB_LAST CPUMOE_MM("v0", CPUMOE_G0) CPUMOE_MM("v1", CPUMOE_G1)      \
      CPUMOE_MM("v2", CPUMOE_G2) CPUMOE_MM("v3", CPUMOE_G3)                               \
          "ld1 {v0.16b-v1.16b}, [%[a1]], %[as]\n\t" CPUMOE_MM("v0", CPUMOE_G4)            \
              CPUMOE_MM("v1", CPUMOE_G5)
#define CPUMOE_STEP_5x1                                                                  \
  CPUMOE_LDA4 CPUMOE_LDB_LAST CPUMOE_MM("v0", CPUMOE_G0) CPUMOE_MM("v1", CPUMOE_G1)      \
      CPUMOE_MM("v2", CPUMOE_G2) CPUMOE_MM("v3", CPUMOE_G3)                               \
          "ld1 {v28.16b}, [%[a1]], %[as]\n\t" CPUMOE_MM("v28", CPUMOE_G4)
#define CPUMOE_Z5 CPUMOE_Z4 "ld1 {v24.4s-v27.4s}, [%[z]]\n\t"
#define CPUMOE_X2(S) S S
#define CPUMOE_X8(S) CPUMOE_X2(CPUMOE_X2(CPUMOE_X2(S)))
// Lhs scale vectors L_p in v0.. (pair p in v<p>).
#define CPUMOE_LS1 "ldr d0, [%[ls]]\n\tzip1 v0.4s, v0.4s, v0.4s\n\t"
#define CPUMOE_LS2 "ldr q0, [%[ls]]\n\tzip2 v1.4s, v0.4s, v0.4s\n\tzip1 v0.4s, v0.4s, v0.4s\n\t"
#define CPUMOE_LS3 \
  "ldr q0, [%[ls]]\n\tldr d2, [%[ls], #16]\n\tzip2 v1.4s, v0.4s, v0.4s\n\tzip1 v0.4s, v0.4s, v0.4s\n\tzip1 v2.4s, v2.4s, v2.4s\n\t"
#define CPUMOE_LS4                                                                        \
  "ldp q0, q2, [%[ls]]\n\tzip2 v1.4s, v0.4s, v0.4s\n\tzip1 v0.4s, v0.4s, v0.4s\n\t"       \
  "zip2 v3.4s, v2.4s, v2.4s\n\tzip1 v2.4s, v2.4s, v2.4s\n\t"
#define CPUMOE_LS5 CPUMOE_LS4 "ldr d4, [%[ls], #32]\n\tzip1 v4.4s, v4.4s, v4.4s\n\t"
#define CPUMOE_LS6 \
  CPUMOE_LS4 "ldr q4, [%[ls], #32]\n\tzip2 v5.4s, v4.4s, v4.4s\n\tzip1 v4.4s, v4.4s, v4.4s\n\t"
// scvtf and * L of one group (4 accumulators).
#define CPUMOE_CVT_(L, r0, r1, r2, r3)                                                       \
  "scvtf " r0 ".4s, " r0 ".4s\n\tscvtf " r1 ".4s, " r1 ".4s\n\tscvtf " r2 ".4s, " r2        \
  ".4s\n\tscvtf " r3 ".4s, " r3 ".4s\n\tfmul " r0 ".4s, " r0 ".4s, " L ".4s\n\tfmul " r1     \
  ".4s, " r1 ".4s, " L ".4s\n\tfmul " r2 ".4s, " r2 ".4s, " L ".4s\n\tfmul " r3 ".4s, " r3 \
  ".4s, " L ".4s\n\t"
#define CPUMOE_CVT(L, ...) CPUMOE_CVT_(L, __VA_ARGS__)
// A block's column scales in v4-v7 and biases in v0-v3 (column pair q: [c2q c2q+1 c2q c2q+1]).
#define CPUMOE_LDRS                                                                       \
  "ld1r {v4.2d}, [%[rs]], #8\n\tld1r {v5.2d}, [%[rs]], #8\n\tld1r {v6.2d}, [%[rs]], #8\n\t" \
  "ld1r {v7.2d}, [%[rs]], #8\n\t"
#define CPUMOE_LDRSB                                                                      \
  CPUMOE_LDRS                                                                             \
  "ld1r {v0.2d}, [%[bias]], #8\n\tld1r {v1.2d}, [%[bias]], #8\n\tld1r {v2.2d}, [%[bias]], #8\n\t" \
  "ld1r {v3.2d}, [%[bias]], #8\n\t"
#define CPUMOE_SC_(r0, r1, r2, r3)                                                        \
  "fmul " r0 ".4s, " r0 ".4s, v4.4s\n\tfmul " r1 ".4s, " r1 ".4s, v5.4s\n\tfmul " r2      \
  ".4s, " r2 ".4s, v6.4s\n\tfmul " r3 ".4s, " r3 ".4s, v7.4s\n\t"
#define CPUMOE_SC(...) CPUMOE_SC_(__VA_ARGS__)
#define CPUMOE_BI_(r0, r1, r2, r3)                                                        \
  "fadd " r0 ".4s, " r0 ".4s, v0.4s\n\tfadd " r1 ".4s, " r1 ".4s, v1.4s\n\tfadd " r2      \
  ".4s, " r2 ".4s, v2.4s\n\tfadd " r3 ".4s, " r3 ".4s, v3.4s\n\t"
#define CPUMOE_BI(...) CPUMOE_BI_(__VA_ARGS__)
#define CPUMOE_NOBI(...)
// Row stores of one group: lane 0 = row 2p, lane 1 = row 2p + 1. The first row of a block goes
// through xd (advanced to the next block), the following rows through xr (xd + stride on entry,
// advanced by the stride), the last row of the tile through xl (advanced by xls: 32 or 0).
#define CPUMOE_ST4(r0, r1, r2, r3, lane, dst) \
  "st4 {" r0 ".d, " r1 ".d, " r2 ".d, " r3 ".d}[" lane "], " dst "\n\t"
#define CPUMOE_STF_(r0, r1, r2, r3) \
  CPUMOE_ST4(r0, r1, r2, r3, "0", "[%[xd]], #32") CPUMOE_ST4(r0, r1, r2, r3, "1", "[%[xr]], %[ds]")
#define CPUMOE_STM_(r0, r1, r2, r3) \
  CPUMOE_ST4(r0, r1, r2, r3, "0", "[%[xr]], %[ds]") CPUMOE_ST4(r0, r1, r2, r3, "1", "[%[xr]], %[ds]")
#define CPUMOE_STL_(r0, r1, r2, r3) \
  CPUMOE_ST4(r0, r1, r2, r3, "0", "[%[xr]], %[ds]") CPUMOE_ST4(r0, r1, r2, r3, "1", "[%[xl]], %[xls]")
#define CPUMOE_STO_(r0, r1, r2, r3) \
  CPUMOE_ST4(r0, r1, r2, r3, "0", "[%[xd]], #32") CPUMOE_ST4(r0, r1, r2, r3, "1", "[%[xl]], %[xls]")
#define CPUMOE_STF(...) CPUMOE_STF_(__VA_ARGS__)
#define CPUMOE_STM(...) CPUMOE_STM_(__VA_ARGS__)
#define CPUMOE_STL(...) CPUMOE_STL_(__VA_ARGS__)
#define CPUMOE_STO(...) CPUMOE_STO_(__VA_ARGS__)
#define CPUMOE_XR "add %[xr], %[xd], %[ds]\n\t"
// One group of a block: * rs, + bias (BI), store with the row form ST.
#define CPUMOE_OUT(BI, ST, G) CPUMOE_SC(G) BI(G) ST(G)
// Epilogues: step 1 for every group, then per block its loads (LD) and groups in row order.
#define CPUMOE_EPI_4x1(BI, LD)                                                                \
  CPUMOE_LS4 CPUMOE_CVT("v0", CPUMOE_G0) CPUMOE_CVT("v1", CPUMOE_G1)                          \
      CPUMOE_CVT("v2", CPUMOE_G2) CPUMOE_CVT("v3", CPUMOE_G3) LD CPUMOE_XR                    \
          CPUMOE_OUT(BI, CPUMOE_STF, CPUMOE_G0) CPUMOE_OUT(BI, CPUMOE_STM, CPUMOE_G1)         \
              CPUMOE_OUT(BI, CPUMOE_STM, CPUMOE_G2) CPUMOE_OUT(BI, CPUMOE_STL, CPUMOE_G3)
#define CPUMOE_EPI_3x1(BI, LD)                                                                \
  CPUMOE_LS3 CPUMOE_CVT("v0", CPUMOE_G0) CPUMOE_CVT("v1", CPUMOE_G1)                          \
      CPUMOE_CVT("v2", CPUMOE_G2) LD CPUMOE_XR CPUMOE_OUT(BI, CPUMOE_STF, CPUMOE_G0)          \
          CPUMOE_OUT(BI, CPUMOE_STM, CPUMOE_G1) CPUMOE_OUT(BI, CPUMOE_STL, CPUMOE_G2)
#define CPUMOE_EPI_3x2(BI, LD)                                                                \
  CPUMOE_LS3 CPUMOE_CVT("v0", CPUMOE_G0) CPUMOE_CVT("v0", CPUMOE_G1)                          \
      CPUMOE_CVT("v1", CPUMOE_G2) CPUMOE_CVT("v1", CPUMOE_G3) CPUMOE_CVT("v2", CPUMOE_G4)     \
          CPUMOE_CVT("v2", CPUMOE_G5) LD CPUMOE_XR CPUMOE_OUT(BI, CPUMOE_STF, CPUMOE_G0)      \
              CPUMOE_OUT(BI, CPUMOE_STM, CPUMOE_G2) CPUMOE_OUT(BI, CPUMOE_STL, CPUMOE_G4)     \
                  LD CPUMOE_XR CPUMOE_OUT(BI, CPUMOE_STF, CPUMOE_G1)                          \
                      CPUMOE_OUT(BI, CPUMOE_STM, CPUMOE_G3) CPUMOE_OUT(BI, CPUMOE_STL, CPUMOE_G5)
#define CPUMOE_EPI_2x1(BI, LD)                                                                \
  CPUMOE_LS2 CPUMOE_CVT("v0", CPUMOE_G0) CPUMOE_CVT("v1", CPUMOE_G1) LD CPUMOE_XR             \
      CPUMOE_OUT(BI, CPUMOE_STF, CPUMOE_G0) CPUMOE_OUT(BI, CPUMOE_STL, CPUMOE_G1)
#define CPUMOE_EPI_2x2(BI, LD)                                                                \
  CPUMOE_LS2 CPUMOE_CVT("v0", CPUMOE_G0) CPUMOE_CVT("v0", CPUMOE_G1)                          \
      CPUMOE_CVT("v1", CPUMOE_G2) CPUMOE_CVT("v1", CPUMOE_G3) LD CPUMOE_XR                    \
          CPUMOE_OUT(BI, CPUMOE_STF, CPUMOE_G0) CPUMOE_OUT(BI, CPUMOE_STL, CPUMOE_G2)         \
              LD CPUMOE_XR CPUMOE_OUT(BI, CPUMOE_STF, CPUMOE_G1)                              \
                  CPUMOE_OUT(BI, CPUMOE_STL, CPUMOE_G3)
#define CPUMOE_EPI_2x3(BI, LD)                                                                \
  CPUMOE_LS2 CPUMOE_CVT("v0", CPUMOE_G0) CPUMOE_CVT("v0", CPUMOE_G1)                          \
      CPUMOE_CVT("v0", CPUMOE_G2) CPUMOE_CVT("v1", CPUMOE_G3) CPUMOE_CVT("v1", CPUMOE_G4)     \
          CPUMOE_CVT("v1", CPUMOE_G5) LD CPUMOE_XR CPUMOE_OUT(BI, CPUMOE_STF, CPUMOE_G0)      \
              CPUMOE_OUT(BI, CPUMOE_STL, CPUMOE_G3) LD CPUMOE_XR                              \
                  CPUMOE_OUT(BI, CPUMOE_STF, CPUMOE_G1) CPUMOE_OUT(BI, CPUMOE_STL, CPUMOE_G4) \
                      LD CPUMOE_XR CPUMOE_OUT(BI, CPUMOE_STF, CPUMOE_G2)                      \
                          CPUMOE_OUT(BI, CPUMOE_STL, CPUMOE_G5)
#define CPUMOE_EPI_1x1(BI, LD) \
  CPUMOE_LS1 CPUMOE_CVT("v0", CPUMOE_G0) LD CPUMOE_OUT(BI, CPUMOE_STO, CPUMOE_G0)
#define CPUMOE_EPI_1x2(BI, LD)                                                                \
  CPUMOE_LS1 CPUMOE_CVT("v0", CPUMOE_G0) CPUMOE_CVT("v0", CPUMOE_G1) LD                       \
      CPUMOE_OUT(BI, CPUMOE_STO, CPUMOE_G0) LD CPUMOE_OUT(BI, CPUMOE_STO, CPUMOE_G1)
#define CPUMOE_EPI_1x3(BI, LD)                                                                \
  CPUMOE_LS1 CPUMOE_CVT("v0", CPUMOE_G0) CPUMOE_CVT("v0", CPUMOE_G1)                          \
      CPUMOE_CVT("v0", CPUMOE_G2) LD CPUMOE_OUT(BI, CPUMOE_STO, CPUMOE_G0) LD                 \
          CPUMOE_OUT(BI, CPUMOE_STO, CPUMOE_G1) LD CPUMOE_OUT(BI, CPUMOE_STO, CPUMOE_G2)
#define CPUMOE_EPI_1x6(BI, LD)                                                                \
  CPUMOE_LS1 CPUMOE_CVT("v0", CPUMOE_G0) CPUMOE_CVT("v0", CPUMOE_G1)                          \
      CPUMOE_CVT("v0", CPUMOE_G2) CPUMOE_CVT("v0", CPUMOE_G3) CPUMOE_CVT("v0", CPUMOE_G4)     \
          CPUMOE_CVT("v0", CPUMOE_G5) LD CPUMOE_OUT(BI, CPUMOE_STO, CPUMOE_G0) LD             \
              CPUMOE_OUT(BI, CPUMOE_STO, CPUMOE_G1) LD CPUMOE_OUT(BI, CPUMOE_STO, CPUMOE_G2)  \
                  LD CPUMOE_OUT(BI, CPUMOE_STO, CPUMOE_G3) LD                                 \
                      CPUMOE_OUT(BI, CPUMOE_STO, CPUMOE_G4) LD                                \
                          CPUMOE_OUT(BI, CPUMOE_STO, CPUMOE_G5)
#define CPUMOE_EPI_5x1(BI, LD)                                                                \
  CPUMOE_LS5 CPUMOE_CVT("v0", CPUMOE_G0) CPUMOE_CVT("v1", CPUMOE_G1)                          \
      CPUMOE_CVT("v2", CPUMOE_G2) CPUMOE_CVT("v3", CPUMOE_G3) CPUMOE_CVT("v4", CPUMOE_G4) LD  \
          CPUMOE_XR CPUMOE_OUT(BI, CPUMOE_STF, CPUMOE_G0)                                     \
              CPUMOE_OUT(BI, CPUMOE_STM, CPUMOE_G1) CPUMOE_OUT(BI, CPUMOE_STM, CPUMOE_G2)     \
                  CPUMOE_OUT(BI, CPUMOE_STM, CPUMOE_G3) CPUMOE_OUT(BI, CPUMOE_STL, CPUMOE_G4)
#define CPUMOE_EPI_6x1(BI, LD)                                                                \
  CPUMOE_LS6 CPUMOE_CVT("v0", CPUMOE_G0) CPUMOE_CVT("v1", CPUMOE_G1)                          \
      CPUMOE_CVT("v2", CPUMOE_G2) CPUMOE_CVT("v3", CPUMOE_G3) CPUMOE_CVT("v4", CPUMOE_G4)     \
          CPUMOE_CVT("v5", CPUMOE_G5) LD CPUMOE_XR CPUMOE_OUT(BI, CPUMOE_STF, CPUMOE_G0)      \
              CPUMOE_OUT(BI, CPUMOE_STM, CPUMOE_G1) CPUMOE_OUT(BI, CPUMOE_STM, CPUMOE_G2)     \
                  CPUMOE_OUT(BI, CPUMOE_STM, CPUMOE_G3) CPUMOE_OUT(BI, CPUMOE_STM, CPUMOE_G4) \
                      CPUMOE_OUT(BI, CPUMOE_STL, CPUMOE_G5)
// One row (a 1 x NB tile of a single row: decode): the row is the low halves of the group, so
// uzp1 gathers it (2 per block), * ls by element, * rs / + bias as loaded (ld1 of 8 columns),
// one st1 of 8 columns: 10 instructions per block instead of 18, and no scratch row.
#define CPUMOE_ROW1_(LD, BIA, r0, r1, r2, r3)                                                  \
  "uzp1 v1.2d, " r0 ".2d, " r1 ".2d\n\tuzp1 v2.2d, " r2 ".2d, " r3 ".2d\n\t"                   \
  "scvtf v1.4s, v1.4s\n\tscvtf v2.4s, v2.4s\n\tfmul v1.4s, v1.4s, v3.s[0]\n\t"               \
  "fmul v2.4s, v2.4s, v3.s[0]\n\tld1 {v4.4s, v5.4s}, [%[rs]], #32\n\t" LD                     \
  "fmul v1.4s, v1.4s, v4.4s\n\tfmul v2.4s, v2.4s, v5.4s\n\t" BIA                              \
  "st1 {v1.4s, v2.4s}, [%[xd]], #32\n\t"
#define CPUMOE_ROW1(LD, BIA, ...) CPUMOE_ROW1_(LD, BIA, __VA_ARGS__)
#define CPUMOE_R1LDB "ld1 {v6.4s, v7.4s}, [%[bias]], #32\n\t"
#define CPUMOE_R1BI "fadd v1.4s, v1.4s, v6.4s\n\tfadd v2.4s, v2.4s, v7.4s\n\t"
#define CPUMOE_EPI1_1x1(LD, BIA) "ldr s3, [%[ls]]\n\t" CPUMOE_ROW1(LD, BIA, CPUMOE_G0)
#define CPUMOE_EPI1_1x2(LD, BIA) CPUMOE_EPI1_1x1(LD, BIA) CPUMOE_ROW1(LD, BIA, CPUMOE_G1)
#define CPUMOE_EPI1_1x3(LD, BIA) CPUMOE_EPI1_1x2(LD, BIA) CPUMOE_ROW1(LD, BIA, CPUMOE_G2)
#define CPUMOE_EPI1_1x6(LD, BIA)                                                              \
  CPUMOE_EPI1_1x3(LD, BIA) CPUMOE_ROW1(LD, BIA, CPUMOE_G3) CPUMOE_ROW1(LD, BIA, CPUMOE_G4)    \
      CPUMOE_ROW1(LD, BIA, CPUMOE_G5)
// The tile loop: per tile zero, k-loop (n32 x 32 slices, then r8 x 8, then r1 single slices),
// the b step to the next tile (NB > 1), the epilogue.
#define CPUMOE_F32_LOOP(Z, AINIT, STEP, BADV, EPI)                                           \
  "1:\n\t" Z AINIT "mov %[n], %[n32]\n\t"                                                    \
  "cbz %[n], 3f\n"                                                                           \
  "2:\n\t" CPUMOE_X8(CPUMOE_X2(CPUMOE_X2(STEP))) "subs %[n], %[n], #1\n\t"                   \
  "b.ne 2b\n"                                                                                \
  "3:\n\t"                                                                                   \
  "cbz %[r8], 5f\n\t"                                                                        \
  "mov %[n], %[r8]\n"                                                                        \
  "4:\n\t" CPUMOE_X8(STEP) "subs %[n], %[n], #1\n\t"                                         \
  "b.ne 4b\n"                                                                                \
  "5:\n\t"                                                                                   \
  "cbz %[r1], 7f\n\t"                                                                        \
  "mov %[n], %[r1]\n"                                                                        \
  "6:\n\t" STEP "subs %[n], %[n], #1\n\t"                                                    \
  "b.ne 6b\n"                                                                                \
  "7:\n\t" BADV EPI "subs %[t], %[t], #1\n\t"                                                \
  "b.ne 1b\n\t"
#define CPUMOE_AINIT1 "mov %[a], %[a0]\n\t"
#define CPUMOE_AINIT2 "mov %[a], %[a0]\n\tmov %[a1], %[a10]\n\t"
#define CPUMOE_BADV "add %[b], %[b], %[bstep]\n\t"
#define CPUMOE_F32_ASM(Z, AINIT, STEP, BADV, EPI)                                                \
  __asm__ volatile(CPUMOE_F32_LOOP(Z, AINIT, STEP, BADV, EPI)                                    \
                   : [a] "=&r"(a), [a1] "=&r"(a1), [n] "=&r"(nn), [xr] "=&r"(xr), [b] "+r"(b),  \
                     [t] "+r"(ntiles), [xd] "+r"(xd), [xl] "+r"(xl), [rs] "+r"(rs),             \
                     [bias] "+r"(bias)                                                           \
                   : [a0] "r"(a0), [a10] "r"(a10), [n32] "r"(n32), [r8] "r"(r8), [r1] "r"(r1),      \
                     [ds] "r"(ds), [xls] "r"(xls), [ls] "r"(ls), [as] "r"(as), [bs] "r"(bs),       \
                     [back] "r"(back), \
                     [bstep] "r"(bstep), [z] "r"(kZeros)                                         \
                   : "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11",    \
                     "v12", "v13", "v14", "v15", "v16", "v17", "v18", "v19", "v20", "v21", "v22", \
                     "v23", "v24", "v25", "v26", "v27", "v28", "v29", "v30", "v31", "cc", "memory")
#define CPUMOE_F32_SHAPE(NP_, NB_, Z, AINIT, BADV)                                          \
  if constexpr (NP == NP_ && NB == NB_) {                                                   \
    if constexpr (kBias)                                                                    \
      CPUMOE_F32_ASM(Z, AINIT, CPUMOE_STEP_##NP_##x##NB_, BADV,                             \
                     CPUMOE_EPI_##NP_##x##NB_(CPUMOE_BI, CPUMOE_LDRSB));                    \
    else                                                                                    \
      CPUMOE_F32_ASM(Z, AINIT, CPUMOE_STEP_##NP_##x##NB_, BADV,                             \
                     CPUMOE_EPI_##NP_##x##NB_(CPUMOE_NOBI, CPUMOE_LDRS));                   \
    return;                                                                                 \
  }
#define CPUMOE_F32_ROW1(NB_, Z, BADV)                                                       \
  if constexpr (NP == 1 && NB == NB_) {                                                     \
    if (rows == 1) {                                                                        \
      if constexpr (kBias)                                                                  \
        CPUMOE_F32_ASM(Z, CPUMOE_AINIT1, CPUMOE_STEP_1x##NB_, BADV,                         \
                       CPUMOE_EPI1_1x##NB_(CPUMOE_R1LDB, CPUMOE_R1BI));                     \
      else                                                                                  \
        CPUMOE_F32_ASM(Z, CPUMOE_AINIT1, CPUMOE_STEP_1x##NB_, BADV, CPUMOE_EPI1_1x##NB_("", "")); \
      return;                                                                               \
    }                                                                                       \
  }

// ntiles >= 1 tiles of NP pairs x NB full blocks: A from a0 (pairs 4.. from the next block for
// NP > 4), B from b (block 0 of the first tile), output row 0 / column 0 of the first tile at d.
// ls, rs, bias: row 0 / column 0 of the first tile; rows: 2 NP - 1 or 2 NP.
template <int NP, int NB, bool kBias>
__attribute__((noinline)) void f32_tiles(const int8_t* a0, const int8_t* b, int64_t kp,
                                         int64_t ntiles, float* xd, int64_t stride,
                                         const float* ls, const float* rs, const float* bias,
                                         int64_t rows) {
  const uint64_t slices = uint64_t(kp) / 8, n32 = slices / 32, r8 = slices % 32 / 8, r1 = slices % 8;
  const int64_t as = kSlice, bs = kNr * kp, back = kSlice - (NB - 1) * kNr * kp;
  const int64_t bstep = (NB - 1) * kNr * kp, ds = stride * int64_t(sizeof(float));
  const int8_t* a10 = a0 + kMr * kp;
  const int8_t *a, *a1;
  uint64_t nn;
  float* xr;
  float* xl = xd;
  int64_t xls = 0;
  CPUMOE_F32_ROW1(6, CPUMOE_Z6, CPUMOE_BADV)
  CPUMOE_F32_ROW1(3, CPUMOE_Z3, CPUMOE_BADV)
  CPUMOE_F32_ROW1(2, CPUMOE_Z2, CPUMOE_BADV)
  CPUMOE_F32_ROW1(1, CPUMOE_Z1, "")
  alignas(16) float lsb[12];
  alignas(16) float scratch[8];
  xl = xd + (2 * NP - 1) * stride;
  xls = 32;
  if (rows < 2 * NP) {  // odd: the last row to scratch, a zero lhs scale for it
    for (int i = 0; i < 2 * NP - 1; ++i) lsb[i] = ls[i];
    lsb[2 * NP - 1] = 0.0f;
    ls = lsb;
    xl = scratch;
    xls = 0;
  }
  CPUMOE_F32_SHAPE(4, 1, CPUMOE_Z4, CPUMOE_AINIT1, "")
  CPUMOE_F32_SHAPE(3, 2, CPUMOE_Z6, CPUMOE_AINIT1, CPUMOE_BADV)
  CPUMOE_F32_SHAPE(3, 1, CPUMOE_Z3, CPUMOE_AINIT1, "")
  CPUMOE_F32_SHAPE(2, 3, CPUMOE_Z6, CPUMOE_AINIT1, CPUMOE_BADV)
  CPUMOE_F32_SHAPE(2, 2, CPUMOE_Z4, CPUMOE_AINIT1, CPUMOE_BADV)
  CPUMOE_F32_SHAPE(2, 1, CPUMOE_Z2, CPUMOE_AINIT1, "")
  CPUMOE_F32_SHAPE(1, 6, CPUMOE_Z6, CPUMOE_AINIT1, CPUMOE_BADV)
  CPUMOE_F32_SHAPE(1, 3, CPUMOE_Z3, CPUMOE_AINIT1, CPUMOE_BADV)
  CPUMOE_F32_SHAPE(1, 2, CPUMOE_Z2, CPUMOE_AINIT1, CPUMOE_BADV)
  CPUMOE_F32_SHAPE(1, 1, CPUMOE_Z1, CPUMOE_AINIT1, "")
  CPUMOE_F32_SHAPE(6, 1, CPUMOE_Z6, CPUMOE_AINIT2, "")
  CPUMOE_F32_SHAPE(5, 1, CPUMOE_Z5, CPUMOE_AINIT2, "")
  (void)a;
  (void)a1;
  (void)nn;
  (void)xr;
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

__attribute__((noinline)) void tail_f32(float* d, int32x4_t lo, int32x4_t hi, int64_t nc, float ls,
                                        const float* rs, const float* bias) {
  neon_store_f32(d, lo, hi, nc, ls, rs, bias);
}

// The outputs of a call from row i0 on. cols(j0) loads what the rows of a full block share; row()
// stores one full row of a block, tail() a row of a partial block.
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
  const int64_t kp = Packing::padded_k(k);
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

// Full blocks [jb, jb + nb) of a row tile of NP pairs at row i0: tiles of NB blocks through the
// asm, the rest in the next smaller shape (6, 3, 2, 1).
template <int NP, int NB, bool kBias>
inline void f32_blocks(const int8_t* a, const int8_t* b, int64_t kp, int64_t i0, int64_t rows,
                       int64_t jb, int64_t nb, const F32Out<kBias>& out) {
  const int64_t tiles = nb / NB;
  if (tiles > 0) {
    const int64_t j0 = jb * kNr;
    f32_tiles<NP, NB, kBias>(a + i0 * kp, b + j0 * kp, kp, tiles, out.d + i0 * out.stride + j0,
                             out.stride, out.ls + i0, out.rs + j0, kBias ? out.bias + j0 : nullptr,
                             rows);
  }
  constexpr int kNext = NB == 6 ? 3 : NB - 1;
  if constexpr (kNext > 0) {
    if (nb > tiles * NB)
      f32_blocks<NP, kNext, kBias>(a, b, kp, i0, rows, jb + tiles * NB, nb - tiles * NB, out);
  }
}

// The row tile at i0 (rows left: m - i0) over full blocks [jb, jb + nb); returns the rows it
// took: 8, or all of the last 9-12 rows (one 5x1 / 6x1 tile over both blocks).
template <bool kBias>
int64_t f32_row_tile(const int8_t* a, const int8_t* b, int64_t kp, int64_t i0, int64_t left,
                     int64_t jb, int64_t nb, const F32Out<kBias>& out) {
  if (left > kMr && left <= kMr + 4) {
    if (left > kMr + 2) f32_blocks<6, 1, kBias>(a, b, kp, i0, left, jb, nb, out);
    else f32_blocks<5, 1, kBias>(a, b, kp, i0, left, jb, nb, out);
    return left;
  }
  const int64_t rows = std::min(kMr, left);
  switch ((rows + 1) / 2) {
    case 4: f32_blocks<4, 1, kBias>(a, b, kp, i0, rows, jb, nb, out); break;
    case 3: f32_blocks<3, 2, kBias>(a, b, kp, i0, rows, jb, nb, out); break;
    case 2: f32_blocks<2, 3, kBias>(a, b, kp, i0, rows, jb, nb, out); break;
    default: f32_blocks<1, 6, kBias>(a, b, kp, i0, rows, jb, nb, out); break;
  }
  return kMr;
}

// The last, partial block of a call (n not a multiple of 8) through the C++ tiles.
template <bool kBias>
__attribute__((noinline)) void f32_partial_block(int64_t m, int64_t n, int64_t k, const void* lhs,
                                                 const int8_t* b, const F32Out<kBias>& out) {
  run(m, n, k, lhs, b, out);
}

// As run(), through the asm row tiles. One row tile (m <= 12: decode and most experts) takes
// every full block in one pass; more row tiles walk steps of 6 blocks (B stays in cache).
template <bool kBias>
void run_f32_tiles(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs,
                   const F32Out<kBias>& out) {
  const int64_t kp = Packing::padded_k(k);
  const auto* a = static_cast<const int8_t*>(lhs);
  const auto* b = static_cast<const int8_t*>(rhs);
  const int64_t full = n / kNr;
  if (m <= kMr + 4) {
    if (full > 0 && m > 0) f32_row_tile(a, b, kp, 0, m, 0, full, out);
  } else {
    for (int64_t jb = 0; jb < full; jb += kStepBlocks) {
      const int64_t nb = std::min(kStepBlocks, full - jb);
      for (int64_t i0 = 0; i0 < m;) i0 += f32_row_tile(a, b, kp, i0, m - i0, jb, nb, out);
    }
  }
  if (n > full * kNr) {
    const int64_t j0 = full * kNr;
    f32_partial_block(m, n - j0, k, lhs, b + j0 * kp,
                      F32Out<kBias>{out.d + j0, out.stride, out.ls, out.rs + j0,
                                    kBias ? out.bias + j0 : nullptr});
  }
}

void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  if (ep.bias != nullptr)
    return run_f32_tiles(m, n, k, lhs, rhs,
                         F32Out<true>{dst, dst_stride, ep.lhs_scale, ep.rhs_scale, ep.bias});
  run_f32_tiles(m, n, k, lhs, rhs,
                F32Out<false>{dst, dst_stride, ep.lhs_scale, ep.rhs_scale, nullptr});
}

}  // namespace

extern const QGemmUkernel qgemm_qs8p8x8_qs8cp8x8_8x8_neon_i8mm = make_qgemm<Packing>(
    "qgemm_qs8p8x8_qs8cp8x8_8x8_neon_i8mm", Isa::neon_i8mm, kMr, pack_lhs, pack_rhs, run_f32);

}  // namespace cpumoe
