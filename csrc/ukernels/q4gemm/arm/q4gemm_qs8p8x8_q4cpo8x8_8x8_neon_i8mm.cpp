// q4gemm_qs8p8x8_q4cpo8x8_8x8_neon_i8mm: the W4A8 GEMM on SMMLA (Armv8.6 FEAT_I8MM).
//
// A is the int8 I8MM kernel's `qs8p8x8` (its packer, qs8p8x8_pack.h): blocks of 8 rows, row pairs
// interleaved in 8-k slices (slice s of a block: 64 bytes at s * 64, pair p at 16 p).
// B (`q4cpo8x8`): blocks of 8 columns (Q4Packing<8, 2, SignedBytes<PairBytes>>: per group the
// codes, 4 g bytes (8-bit codes: 8 g), then the 8 scales: fp32 for int4 and int8_affine; mxfp4's
// E8M0 bytes widened at packing to the bf16 of w4_mxfp4_scale, exact, so that the group end loads
// them with one ldr and two shll instead of a 10-instruction E8M0 decode: 144 bytes per 8 columns
// and group instead of 136). Per 8-k slice s of a group, two 16-byte registers (slices 2t, 2t + 1:
// 64 bytes at t * 64, register 2 (s % 2) + q at 16 of those): register q holds the `qs8cp8x8`
// SMMLA operand of column pair q (column 2q's 8 k, then column 2q + 1's) in its low nibbles and
// that of column pair q + 2 in its high nibbles, byte for byte. The int4 low nibbles are stored
// offset (v + 8, 0..15), the high ones as two's complement, so the raw byte read as int8 is
// exactly 16 hi + lo + 8: it is itself an SMMLA operand, and one `and #0x0f` makes the other
// (lo + 8). Per register:
//   Y = SMMLA(a, r & 0x0f) = sum a lo + 8 sum a,   X = SMMLA(a, r) = 16 sum a hi + Y,
// so at the group end X - Y is 16 times column pair q + 2's sum (scvtf #4 undoes the 16), and Y
// is column pair q's sum once 8 sum a is taken off: the accumulators start each group at
// -8 sum a of their rows over the group (init_sums: made per call from packed A, 64 bytes per row
// pair and group, in the call's scratch: scratch_bytes). One instruction unpacks 32 weights (the
// naive shl / and pair takes two).
// mxfp4 codes go through a tbl of the format's table on r & 0x0f and r >> 4 (2 * E2M1 up to 12:
// no such trick), in the same arrangement, and start from zero. Groups of 32 k (mxfp4's, and int4
// g32 as a variant) are one iteration of the k loop: no loop there.
// int8_affine's 8-bit codes (Q4GemmUkernel::codes8) are the `qs8cp8x8` operands themselves, as
// the int8 kernel packs its weights: per 8-k slice s, 64 bytes at s * 64, column pair q's operand
// (column 2q's 8 k, then 2q + 1's) at 16 q, each code stored as its int8 value c - 128 (c ^ 0x80,
// SignedBytes). Per slice pair and block two ld1 of 4 registers feed the SMMLA with no unpacking
// (int4: one ld1 and 4 `and`), into the same accumulators (column pairs 0-3) and group end as
// int4 less the X - Y step (plain scvtf), starting from zero (no init_sums, no scratch);
// |sum| <= 128 * 128 * g <= 2^30. g32 is a variant here too.
//
// Register tiles: NP row pairs x NB column blocks, each one asm over all groups (below): int32
// accumulators for the current group (4 per pair and block, as in the int8 kernel: [r c, r c+1,
// r+1 c, r+1 c+1]); at the group end each goes through scvtf, one fmul by its column pair's group
// scales ([s_c s_c+1 s_c s_c+1]: one `dup .d`) and one fadd into the fp32 totals: the oracle's
// acc + float(isum) * s, in g order, no FMA. One-row tiles (decode) put row 0 of 4 columns in
// one accumulator (A's zero pad row swapped in for every other column pair: see there), halving
// the group-end work. Tiles: 1 row: 1x4 (8 int32 accumulators, the totals in registers too);
// 2 rows: 1x2 (likewise); 3-8 rows: 2x1, 3x1, 4x1 (one whole A block
// per column block: the unpacking of each B register serves up to 4 row pairs; the totals in a
// small stack array, one ld1 and st1 per pair and group).
// With Q4GemmEpilogue::lhs_group_scale, variants of every tile's asm (template flag kGs, so the
// plain ones are unchanged) load per group the rows' group scales in the accumulators' lane order
// (one-row tiles: a0 in all lanes, one ldr s; row pairs: [a_r a_r a_r+1 a_r+1], two loads and a
// zip1) and multiply each scaled product by it before the fadd: the oracle's (float(isum) * s) * a.
// Instruction counts (qemu, tests_cpp/bench/q4gemm_insn_bench.cpp): see the README's W4A8 table.
//
// Walk: a call of one row tile (m <= 8: decode and most experts) passes over its columns once,
// so each weight byte is read exactly once per call (decode streams B: 64 bytes per 8 SMMLA per
// row pair, 128 for 8-bit codes); more rows walk steps of 6 column blocks outer and row tiles
// inner, so a step's packed B (6 x (4 k or 8 k + scales) bytes) stays in L1/L2 while the row tiles
// pass. The sums do not depend on the tiling. A partial last block (n % 8) is computed whole (its
// padding codes are the value 0) and stored to its first n % 8 columns only.
// @pre m, n >= 0, k % group == 0, group % 32 == 0, group <= kW4MaxGroup (|X| <= g * 128 * 136
//      fits int32; 8-bit codes g * 128 * 128); packed buffers from this kernel's packers.
// Features used: NEON, I8MM (SMMLA).
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_MATMUL_INT8)
#error "q4gemm_qs8p8x8_q4cpo8x8_8x8_neon_i8mm.cpp needs -march=armv8.2-a+i8mm (set per file by CMake)"
#endif

#include <arm_neon.h>

#include <algorithm>

#include "cpumoe/q4gemm.h"
#include "ukernels/q4gemm/arm/q4gemm_arm_common.h"
#include "ukernels/q4gemm/q4gemm_common.h"
#include "ukernels/qgemm/arm/qs8p8x8_pack.h"

namespace cpumoe {
namespace {

constexpr int64_t kMr = 8;
constexpr int64_t kNr = 8;
constexpr int64_t kStepBlocks = 6;  // column blocks per step of the walk (m > 8)
using LhsPacking = QGemmPacking<kNr, 8, 1, 8>;  // the int8 kernel's qs8p8x8 (kp = k here)

// Nibble position of column c's code kk of a group (see the file comment).
struct PairNibbles {
  static int64_t index(int64_t c, int64_t kk, int64_t /*g*/) {
    const int64_t s = kk / 8, q = (c / 2) % 2;
    const int64_t byte = (s / 2) * 64 + (s % 2) * 32 + q * 16 + (c % 2) * 8 + kk % 8;
    return 2 * byte + c / 4;  // column pairs 0, 1 low nibbles; 2, 3 high
  }
};
// Byte position of column c's 8-bit code kk: slice s's 4 SMMLA operands (`qs8cp8x8`, column
// pair q at 16 q) at 64 s (see the file comment).
struct PairBytes {
  static int64_t index(int64_t c, int64_t kk, int64_t /*g*/) {
    return (kk / 8) * 64 + (c / 2) * 16 + (c % 2) * 8 + kk % 8;
  }
};
// mxfp4 scales stored as bf16 (exact): one ldr and two shll per 8, instead of the E8M0 decode.
using Packing = Q4Packing<kNr, 2, SignedBytes<PairBytes>>;

void pack_lhs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  pack_lhs_qs8p8x8(m, k, LhsPacking::padded_k(k), rows, static_cast<int8_t*>(packed));
}

// What a tile needs of the call.
struct Call {
  int64_t g, groups;
  size_t block_bytes;
  const int8_t* table;
  int64_t init_step;  // bytes per row pair of the start values: 64, or 0 (mxfp4, 8-bit codes)
};

// The int4 accumulators' start values of the m rows at packed A `a` (whole A blocks): row tile t
// (np row pairs) at int32 t * groups * 64, per group np * 16 int32: pair p's
// [-8 S0, -8 S0, -8 S1, -8 S1] four times
// (one ld1 fills four accumulators), S0 and S1 its rows' sums over the group (a one-row tile:
// [-8 S0, -8 S0, -8 S0, -8 S0], see the one-row tiles); then one group of
// slack (the asm loads the next group's values after the last). Sums of int8 over a group fit
// int32 easily (|8 S| <= 1024 * kW4MaxGroup). In the call's scratch; mxfp4 and 8-bit codes need
// none (they start from zero).
size_t scratch_bytes(int64_t m, int64_t n, int64_t k, const W4Layout& w) {
  if (w.format != W4Format::int4 || m <= 0 || n <= 0) return 0;
  return size_t(((m + kMr - 1) / kMr) * (k / w.group) + 1) * 64 * sizeof(int32_t);
}

const int32_t* init_sums(int64_t m, int64_t k, int64_t g, const int8_t* a, void* scratch) {
  const int64_t groups = k / g, tiles = (m + kMr - 1) / kMr;
  int32_t* const buf = static_cast<int32_t*>(scratch);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = std::min(kMr, m - t * kMr), np = (rows + 1) / 2;
    const int8_t* blk = a + t * kMr * k;
    int32_t* d = buf + t * groups * 64;
    for (int64_t gi = 0; gi < groups; ++gi) {
      for (int64_t p = 0; p < np; ++p) {
        int32x4_t acc = vdupq_n_s32(0);
        for (int64_t s = gi * g / 8; s < (gi + 1) * g / 8; ++s)
          acc = vpadalq_s16(acc, vpaddlq_s8(vld1q_s8(blk + s * 64 + 16 * p)));
        const int32x4_t pr = vpaddq_s32(acc, acc);  // [S0, S1, S0, S1]
        // One-row tiles hold row 0 in all four lanes (the A' operand of the asm below).
        const int32x4_t v =
            vmulq_n_s32(rows == 1 ? vdupq_laneq_s32(pr, 0) : vzip1q_s32(pr, pr), -8);
        for (int x = 0; x < 4; ++x) vst1q_s32(d + 16 * p + 4 * x, v);
      }
      d += np * 16;
    }
  }
  return buf;
}

// --- The tiles, each one asm over all groups ---------------------------------------------------
// (GCC keeps part of an intrinsics accumulator array in memory, with stores in the k loop.)
// Scratch registers: A slices 2t in v0..v3 and 2t + 1 in v4..v7 (one ld1 each), a block's 4 code
// registers in v8-v11 (one ld1: slice 2t's registers 0, 1, then slice 2t + 1's; the blocks of a
// tile are bs bytes apart: post-index bs, and `back` = 64 - (NB - 1) bs after the last), the
// unpacked operands in v12 (low nibbles), v13 (mxfp4's high nibbles; int4's high operand is the
// code register itself); mask and table are operands (v14, v15 when all else is taken). The int32
// accumulators of the group in v16.. (pair p, block j, column pair c: v16 + (p * NB + j) * 4 + c).
// Per slice pair and block: 1 + 4 (int4) or 16 (mxfp4) instructions of loads and unpacking for
// 8 NP SMMLA; 8-bit codes (B8): two ld1 into v8-v11 (slice 2t's 4 operands, then 2t + 1's: the
// first post-indexed #64, the second by b8 = bs - 64 to the next block or by `back`), no
// unpacking. Two slice pairs per iteration (a group has an even number: g % 32 == 0). After a
// group's k loop the code pointer is at block 0's scales; the group end adds its products to the
// fp32 totals, loads the next group's start values (one ld1 per 4 accumulators, from the
// init_sums pointer c, which steps cs bytes per row pair: 64, or 0 on a zero block for mxfp4)
// and steps over the scales (the post-index of block 0's scale load).
#define Q4_MM(x, a, b) "smmla " x ".4s, " a ".16b, " b ".16b\n\t"
#define Q4_UNP_I4(r) "and v12.16b, " r ".16b, %[mask].16b\n\t"
#define Q4_UNP_I4_HI(r) r
#define Q4_UNP_MX(r)                                                               \
  "and v12.16b, " r ".16b, %[mask].16b\n\tushr v13.16b, " r ".16b, #4\n\t"         \
  "tbl v12.16b, {%[tab].16b}, v12.16b\n\ttbl v13.16b, {%[tab].16b}, v13.16b\n\t"
#define Q4_UNP_MX_HI(r) "v13"
// 8-bit codes: a block's slice 2t (then Q4_LDB8(step): 2t + 1, post-index step).
#define Q4_LDB8_64 "ld1 {v8.16b-v11.16b}, [%[b]], #64\n\t"
#define Q4_LDB8(step) "ld1 {v8.16b-v11.16b}, [%[b]], %[" #step "]\n\t"
#define Q4_V(i) Q4_V_##i
#define Q4_V_0 "v16"
#define Q4_V_1 "v17"
#define Q4_V_2 "v18"
#define Q4_V_3 "v19"
#define Q4_V_4 "v20"
#define Q4_V_5 "v21"
#define Q4_V_6 "v22"
#define Q4_V_7 "v23"
#define Q4_V_8 "v24"
#define Q4_V_9 "v25"
#define Q4_V_10 "v26"
#define Q4_V_11 "v27"
#define Q4_V_12 "v28"
#define Q4_V_13 "v29"
#define Q4_V_14 "v30"
#define Q4_V_15 "v31"
// Code register r (column pairs q and q + 2: accumulators l, h of each pair) against the A slice
// in registers a0.. for 1-4 row pairs.
#define Q4_MM2(U, r, a, l, h) Q4_MM(Q4_V(l), a, "v12") Q4_MM(Q4_V(h), a, U##_HI(r))
#define Q4_R1(U, r, a0, l0, h0) U(r) Q4_MM2(U, r, a0, l0, h0)
#define Q4_R2(U, r, a0, a1, l0, h0, l1, h1) Q4_R1(U, r, a0, l0, h0) Q4_MM2(U, r, a1, l1, h1)
#define Q4_R3(U, r, a0, a1, a2, l0, h0, l1, h1, l2, h2) \
  Q4_R2(U, r, a0, a1, l0, h0, l1, h1) Q4_MM2(U, r, a2, l2, h2)
#define Q4_R4(U, r, a0, a1, a2, a3, l0, h0, l1, h1, l2, h2, l3, h3) \
  Q4_R3(U, r, a0, a1, a2, l0, h0, l1, h1, l2, h2) Q4_MM2(U, r, a3, l3, h3)
#define Q4_LDA(l0, l1) "ld1 {" l0 "}, [%[a]], %[s64]\n\tld1 {" l1 "}, [%[a]], %[s64]\n\t"
#define Q4_LDA1 Q4_LDA("v0.16b", "v4.16b")
#define Q4_LDA2 Q4_LDA("v0.16b-v1.16b", "v4.16b-v5.16b")
#define Q4_LDA3 Q4_LDA("v0.16b-v2.16b", "v4.16b-v6.16b")
#define Q4_LDA4 Q4_LDA("v0.16b-v3.16b", "v4.16b-v7.16b")
#define Q4_LDB(step) "ld1 {v8.16b-v11.16b}, [%[b]], %[" #step "]\n\t"
// Block j (accumulators c, c + 1, c + 2, c + 3 = column pairs 0-3) of a one-pair tile.
#define Q4_B1(U, c0, c1, c2, c3)                                                         \
  Q4_R1(U, "v8", "v0", c0, c2) Q4_R1(U, "v9", "v0", c1, c3) Q4_R1(U, "v10", "v4", c0, c2) \
      Q4_R1(U, "v11", "v4", c1, c3)
// One slice pair of each shape NPxNB.
#define Q4_S1x1(U) Q4_LDA1 Q4_LDB(back) Q4_B1(U, 0, 1, 2, 3)
#define Q4_S1x2(U) Q4_LDA1 Q4_LDB(bs) Q4_B1(U, 0, 1, 2, 3) Q4_LDB(back) Q4_B1(U, 4, 5, 6, 7)
#define Q4_S2x1(U)                                                                            \
  Q4_LDA2 Q4_LDB(back) Q4_R2(U, "v8", "v0", "v1", 0, 2, 4, 6) Q4_R2(U, "v9", "v0", "v1", 1, 3, 5, 7) \
      Q4_R2(U, "v10", "v4", "v5", 0, 2, 4, 6) Q4_R2(U, "v11", "v4", "v5", 1, 3, 5, 7)
#define Q4_S3x1(U)                                                                          \
  Q4_LDA3 Q4_LDB(back) Q4_R3(U, "v8", "v0", "v1", "v2", 0, 2, 4, 6, 8, 10)                  \
      Q4_R3(U, "v9", "v0", "v1", "v2", 1, 3, 5, 7, 9, 11)                                   \
          Q4_R3(U, "v10", "v4", "v5", "v6", 0, 2, 4, 6, 8, 10)                              \
              Q4_R3(U, "v11", "v4", "v5", "v6", 1, 3, 5, 7, 9, 11)
#define Q4_S4x1(U)                                                                          \
  Q4_LDA4 Q4_LDB(back) Q4_R4(U, "v8", "v0", "v1", "v2", "v3", 0, 2, 4, 6, 8, 10, 12, 14)    \
      Q4_R4(U, "v9", "v0", "v1", "v2", "v3", 1, 3, 5, 7, 9, 11, 13, 15)                     \
          Q4_R4(U, "v10", "v4", "v5", "v6", "v7", 0, 2, 4, 6, 8, 10, 12, 14)                \
              Q4_R4(U, "v11", "v4", "v5", "v6", "v7", 1, 3, 5, 7, 9, 11, 13, 15)
// 8-bit codes: the 4 operand registers (column pairs 0-3) against A slice a0.. of 1-4 row
// pairs, accumulators l0.. of column pair 0 (+1, +2, +3 for the others).
#define Q4_B8_R1(r, a0, l0) Q4_MM(Q4_V(l0), a0, r)
#define Q4_B8_R2(r, a0, a1, l0, l1) Q4_B8_R1(r, a0, l0) Q4_MM(Q4_V(l1), a1, r)
#define Q4_B8_R3(r, a0, a1, a2, l0, l1, l2) Q4_B8_R2(r, a0, a1, l0, l1) Q4_MM(Q4_V(l2), a2, r)
#define Q4_B8_R4(r, a0, a1, a2, a3, l0, l1, l2, l3) \
  Q4_B8_R3(r, a0, a1, a2, l0, l1, l2) Q4_MM(Q4_V(l3), a3, r)
#define Q4_B8_1(a, c0, c1, c2, c3) \
  Q4_B8_R1("v8", a, c0) Q4_B8_R1("v9", a, c1) Q4_B8_R1("v10", a, c2) Q4_B8_R1("v11", a, c3)
#define Q4_B8_2(a0, a1)                                                                      \
  Q4_B8_R2("v8", a0, a1, 0, 4) Q4_B8_R2("v9", a0, a1, 1, 5) Q4_B8_R2("v10", a0, a1, 2, 6)    \
      Q4_B8_R2("v11", a0, a1, 3, 7)
#define Q4_B8_3(a0, a1, a2)                                                                  \
  Q4_B8_R3("v8", a0, a1, a2, 0, 4, 8) Q4_B8_R3("v9", a0, a1, a2, 1, 5, 9)                    \
      Q4_B8_R3("v10", a0, a1, a2, 2, 6, 10) Q4_B8_R3("v11", a0, a1, a2, 3, 7, 11)
#define Q4_B8_4(a0, a1, a2, a3)                                                              \
  Q4_B8_R4("v8", a0, a1, a2, a3, 0, 4, 8, 12) Q4_B8_R4("v9", a0, a1, a2, a3, 1, 5, 9, 13)    \
      Q4_B8_R4("v10", a0, a1, a2, a3, 2, 6, 10, 14)                                          \
          Q4_B8_R4("v11", a0, a1, a2, a3, 3, 7, 11, 15)
#define Q4_S8_1x1 \
  Q4_LDA1 Q4_LDB8_64 Q4_B8_1("v0", 0, 1, 2, 3) Q4_LDB8(back) Q4_B8_1("v4", 0, 1, 2, 3)
#define Q4_S8_1x2                                                                              \
  Q4_LDA1 Q4_LDB8_64 Q4_B8_1("v0", 0, 1, 2, 3) Q4_LDB8(b8) Q4_B8_1("v4", 0, 1, 2, 3)           \
      Q4_LDB8_64 Q4_B8_1("v0", 4, 5, 6, 7) Q4_LDB8(back) Q4_B8_1("v4", 4, 5, 6, 7)
#define Q4_S8_2x1 Q4_LDA2 Q4_LDB8_64 Q4_B8_2("v0", "v1") Q4_LDB8(back) Q4_B8_2("v4", "v5")
#define Q4_S8_3x1 \
  Q4_LDA3 Q4_LDB8_64 Q4_B8_3("v0", "v1", "v2") Q4_LDB8(back) Q4_B8_3("v4", "v5", "v6")
#define Q4_S8_4x1 \
  Q4_LDA4 Q4_LDB8_64 Q4_B8_4("v0", "v1", "v2", "v3") Q4_LDB8(back) Q4_B8_4("v4", "v5", "v6", "v7")
#define Q4_LOOP(S) "mov %[n], %[np2]\n1:\n\t" S S "subs %[n], %[n], #1\n\tb.ne 1b\n\t"
#define Q4_LOOP_G32(S) S S  // a 32-k group (mxfp4's always) is one slice pair: no loop
#define Q4_CLOB                                                                            \
  "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11", "v12", "v13", \
      "cc", "memory"
// Group end, int4: X (column pairs 2, 3) less Y (0, 1), then scvtf #4 on it and plain on Y;
// mxfp4: plain scvtf on all.
#define Q4_SUB_I4(x, y) "sub " x ".4s, " x ".4s, " y ".4s\n\t"
#define Q4_SUB_MX(x, y) ""
#define Q4_SUB_B8(x, y) ""
#define Q4_CVL(r) "scvtf " r ".4s, " r ".4s\n\t"
#define Q4_CVH_I4(r) "scvtf " r ".4s, " r ".4s, #4\n\t"
#define Q4_CVH_MX(r) Q4_CVL(r)
#define Q4_CVH_B8(r) Q4_CVL(r)

// One-pair tiles (one or two rows: decode), totals in v24..: per group end and block, the 8
// scales into v1, v2 (int4: one ldp; mxfp4: one ldr of the bf16 scales, two shll), then
//   one row (1-4 blocks, below): (int4) 1 sub, 2 scvtf, 2 fmul, 2 fadd into 2 totals per block
//            (row 0 of columns 0-3, 4-7);
//   two rows (1-2 blocks): (int4) 2 sub, per column pair a dup .d of its 2 scales, scvtf, fmul,
//            fadd into 4 totals per block (lanes as the accumulators).
// Block 0's scales are loaded with a post-index over them (the bytes of a group's 8 scales:
// Q4_SB_*), block 1's at s = b + bsc (bsc = bs - those bytes), block j + 1's at s + bs.
#define Q4_SB_I4 "#32"
#define Q4_SB_MX "#16"
#define Q4_SB_B8 Q4_SB_I4
#define Q4_SC_I4(addr) "ldp q1, q2, " addr "\n\t"
#define Q4_SC_MX(addr) "ldr q1, " addr "\n\tshll2 v2.4s, v1.8h, #16\n\tshll v1.4s, v1.4h, #16\n\t"
#define Q4_SC_B8(addr) Q4_SC_I4(addr)
#define Q4_B0(F) "[%[b]], " Q4_SB_##F
#define Q4_INIT1 "ld1 {v16.4s-v19.4s}, [%[c]], %[cs]\n\t"
#define Q4_INIT2 "ld1 {v16.4s-v19.4s}, [%[c]]\n\tld1 {v20.4s-v23.4s}, [%[c]], %[cs]\n\t"
// kGs (G = 1): the scaled products x0, x1 times the group scales ga, lanes as theirs.
#define Q4_GS0(x0, x1, ga) ""
#define Q4_GS1(x0, x1, ga) \
  "fmul " x0 ".4s, " x0 ".4s, " ga "\n\tfmul " x1 ".4s, " x1 ".4s, " ga "\n\t"
// kGs: a two-row tile's [a0 a0 a1 a1] into v0 (free at the group end; v4 a temporary).
#define Q4_GLP0 ""
#define Q4_GLP1 \
  "ld1r {v0.2s}, [%[g0]], #4\n\tld1r {v4.2s}, [%[g1]], #4\n\tzip1 v0.2d, v0.2d, v4.2d\n\t"
#define Q4_R2_HALF(CV, G, sc, a0, a1, f0, f1)                                           \
  "dup v3.2d, " sc ".d[0]\n\tdup v5.2d, " sc ".d[1]\n\t" CV(a0) CV(a1)                 \
  "fmul " a0 ".4s, " a0 ".4s, v3.4s\n\tfmul " a1 ".4s, " a1 ".4s, v5.4s\n\t"            \
  Q4_GS##G(a0, a1, "v0.4s")                                                             \
  "fadd " f0 ".4s, " f0 ".4s, " a0 ".4s\n\tfadd " f1 ".4s, " f1 ".4s, " a1 ".4s\n\t"
#define Q4_R2_END(F, G, addr, a0, a1, a2, a3, f0, f1, f2, f3)                            \
  Q4_SC_##F(addr) Q4_SUB_##F(a2, a0) Q4_SUB_##F(a3, a1)                                  \
  Q4_R2_HALF(Q4_CVL, G, "v1", a0, a1, f0, f1)                                            \
  Q4_R2_HALF(Q4_CVH_##F, G, "v2", a2, a3, f2, f3)
#define Q4_R2_ENDS_1(F, G)                                                              \
  Q4_GLP##G Q4_R2_END(F, G, Q4_B0(F), "v16", "v17", "v18", "v19", "v24", "v25", "v26", "v27") \
  Q4_INIT1
#define Q4_R2_ENDS_2(F, G)                                                              \
  Q4_GLP##G Q4_R2_END(F, G, Q4_B0(F), "v16", "v17", "v18", "v19", "v24", "v25", "v26", "v27") \
  "add %[s], %[b], %[bsc]\n\t"                                                          \
  Q4_R2_END(F, G, "[%[s]]", "v20", "v21", "v22", "v23", "v28", "v29", "v30", "v31") Q4_INIT2
// kGs: the group scale pointers of rows 0 and 1 (one float per group).
#define Q4_GOPS_P0
#define Q4_GOPS_P1 , [g0] "+r"(g0), [g1] "+r"(g1)
// One pass of a one-pair tile over all groups: zeroed totals (v24-v31), the accumulators'
// start values (INIT), per group the k steps (BODY) and the group end (ENDS), then the store.
#define Q4_PAIR_ASM(INIT, BODY, ENDS, ST, G)                                             \
  __asm__ volatile(                                                                      \
      "ld1 {v24.4s-v27.4s}, [%[z]]\n\tld1 {v28.4s-v31.4s}, [%[z]]\n\t" INIT                \
      "2:\n\t" BODY ENDS "subs %[gn], %[gn], #1\n\tb.ne 2b\n\t" ST                        \
      : [a] "+r"(a), [b] "+r"(b), [gn] "+r"(gn), [n] "=&r"(n), [s] "=&r"(s), [o] "+r"(o), \
        [c] "+r"(c) Q4_GOPS_P##G                                                         \
      : [np2] "r"(np2), [s64] "r"(s64), [bs] "r"(bs), [back] "r"(back), [bsc] "r"(bsc),  \
        [b8] "r"(b8), [cs] "r"(cs), [mask] "w"(mask), [tab] "w"(tab), [z] "r"(kZeros)    \
      : Q4_CLOB, "v16", "v17", "v18", "v19", "v20", "v21", "v22", "v23", "v24", "v25",   \
        "v26", "v27", "v28", "v29", "v30", "v31")
#define Q4_P1_BODY_I4(NB_) Q4_S1x##NB_(Q4_UNP_I4)
#define Q4_P1_BODY_MX(NB_) Q4_S1x##NB_(Q4_UNP_MX)
#define Q4_P1_BODY_B8(NB_) Q4_S8_1x##NB_
#define Q4_P1_ASM(NB_, F, LOOP, ST, G) \
  Q4_PAIR_ASM(Q4_INIT##NB_, LOOP(Q4_P1_BODY_##F(NB_)), Q4_R2_ENDS_##NB_(F, G), ST, G)
// The format / group-size / kGs variants of a one-pair tile (ASM: Q4_P1_ASM or Q4_O_ASM).
#define Q4_PAIR_FMT_G(ASM, NB_, ST, G)                                     \
  if constexpr (F == W4Format::mxfp4) ASM(NB_, MX, Q4_LOOP_G32, ST, G);     \
  else if constexpr (F == W4Format::int8_affine && kG32) ASM(NB_, B8, Q4_LOOP_G32, ST, G); \
  else if constexpr (F == W4Format::int8_affine) ASM(NB_, B8, Q4_LOOP, ST, G); \
  else if constexpr (kG32) ASM(NB_, I4, Q4_LOOP_G32, ST, G);               \
  else ASM(NB_, I4, Q4_LOOP, ST, G);
#define Q4_PAIR_FMT(ASM, NB_, ST)                     \
  if constexpr (kGs) { Q4_PAIR_FMT_G(ASM, NB_, ST, 1) } \
  else { Q4_PAIR_FMT_G(ASM, NB_, ST, 0) }
#define Q4_ST1 "st1 {v24.4s-v25.4s}, [%[o]]\n\t"
#define Q4_ST2 "st1 {v24.4s-v27.4s}, [%[o]]\n\t"
#define Q4_ST3 "st1 {v24.4s-v27.4s}, [%[o]], #64\n\tst1 {v28.4s-v29.4s}, [%[o]]\n\t"
#define Q4_ST4 "st1 {v24.4s-v27.4s}, [%[o]], #64\n\tst1 {v28.4s-v31.4s}, [%[o]]\n\t"

// One-row tiles (1-4 blocks). Row 0's half of an A slice is loaded alone (ldr d: A = [a, 0],
// whatever row 1 holds), and A' = [0, a] (one ext) against column pair q + 1's operands
// (registers 1 and 3 of a slice pair) puts row 0 of those columns in lanes 2, 3 of the same
// accumulator as column pair q's (lanes 0, 1, against A): per block two accumulators, row 0 of
// columns 0-3 (low nibbles) and 4-7 (high), so the group end needs no zip, and four blocks fit
// (accumulators v16-v23, totals v24-v31) to share each A load. int4's start values are -8 S0 in
// all four lanes (init_sums).
#define Q4_O_LDA                                                                     \
  "ldr d0, [%[a]], #64\n\tldr d4, [%[a]], #64\n\t"                                   \
  "ext v1.16b, v0.16b, v0.16b, #8\n\text v5.16b, v4.16b, v4.16b, #8\n\t"
#define Q4_O_BLK(U, l, h)                                                                    \
  Q4_R1(U, "v8", "v0", l, h) Q4_R1(U, "v9", "v1", l, h) Q4_R1(U, "v10", "v4", l, h)          \
      Q4_R1(U, "v11", "v5", l, h)
#define Q4_O_S1(U) Q4_O_LDA Q4_LDB(back) Q4_O_BLK(U, 0, 1)
#define Q4_O_S2(U) Q4_O_LDA Q4_LDB(bs) Q4_O_BLK(U, 0, 1) Q4_LDB(back) Q4_O_BLK(U, 2, 3)
#define Q4_O_S3(U)                                                                            \
  Q4_O_LDA Q4_LDB(bs) Q4_O_BLK(U, 0, 1) Q4_LDB(bs) Q4_O_BLK(U, 2, 3) Q4_LDB(back)            \
      Q4_O_BLK(U, 4, 5)
#define Q4_O_S4(U)                                                                            \
  Q4_O_LDA Q4_LDB(bs) Q4_O_BLK(U, 0, 1) Q4_LDB(bs) Q4_O_BLK(U, 2, 3) Q4_LDB(bs)              \
      Q4_O_BLK(U, 4, 5) Q4_LDB(back) Q4_O_BLK(U, 6, 7)
// 8-bit codes: column pairs 0, 2 against A, 1, 3 against A'; the slice 2t + 1 load steps by
// `step` (b8 to the next block, back after the last).
#define Q4_O8_BLK(l, h, step)                                                                 \
  Q4_LDB8_64 Q4_MM(Q4_V(l), "v0", "v8") Q4_MM(Q4_V(h), "v0", "v10")                          \
      Q4_MM(Q4_V(l), "v1", "v9") Q4_MM(Q4_V(h), "v1", "v11") Q4_LDB8(step)                    \
          Q4_MM(Q4_V(l), "v4", "v8") Q4_MM(Q4_V(h), "v4", "v10") Q4_MM(Q4_V(l), "v5", "v9")  \
              Q4_MM(Q4_V(h), "v5", "v11")
#define Q4_O8_S1 Q4_O_LDA Q4_O8_BLK(0, 1, back)
#define Q4_O8_S2 Q4_O_LDA Q4_O8_BLK(0, 1, b8) Q4_O8_BLK(2, 3, back)
#define Q4_O8_S3 Q4_O_LDA Q4_O8_BLK(0, 1, b8) Q4_O8_BLK(2, 3, b8) Q4_O8_BLK(4, 5, back)
#define Q4_O8_S4 \
  Q4_O_LDA Q4_O8_BLK(0, 1, b8) Q4_O8_BLK(2, 3, b8) Q4_O8_BLK(4, 5, b8) Q4_O8_BLK(6, 7, back)
// kGs: row 0's group scale in lane 0 of v0 (free at the group end), by element.
#define Q4_O_END(F, G, addr, l, h, f0, f1)                                                  \
  Q4_SC_##F(addr) Q4_SUB_##F(h, l) Q4_CVL(l) Q4_CVH_##F(h)                                  \
  "fmul " l ".4s, " l ".4s, v1.4s\n\tfmul " h ".4s, " h ".4s, v2.4s\n\t"                    \
  Q4_GS##G(l, h, "v0.s[0]")                                                                 \
  "fadd " f0 ".4s, " f0 ".4s, " l ".4s\n\tfadd " f1 ".4s, " f1 ".4s, " h ".4s\n\t"
#define Q4_O_GL0 ""
#define Q4_O_GL1 "ldr s0, [%[g0]], #4\n\t"
#define Q4_O_E0(F, G) Q4_O_GL##G Q4_O_END(F, G, Q4_B0(F), "v16", "v17", "v24", "v25")
#define Q4_O_E1(F, G) \
  "add %[s], %[b], %[bsc]\n\t" Q4_O_END(F, G, "[%[s]]", "v18", "v19", "v26", "v27")
#define Q4_O_E2(F, G) \
  "add %[s], %[s], %[bs]\n\t" Q4_O_END(F, G, "[%[s]]", "v20", "v21", "v28", "v29")
#define Q4_O_E3(F, G) \
  "add %[s], %[s], %[bs]\n\t" Q4_O_END(F, G, "[%[s]]", "v22", "v23", "v30", "v31")
#define Q4_O_ENDS_1(F, G) Q4_O_E0(F, G) Q4_INIT1
#define Q4_O_ENDS_2(F, G) Q4_O_E0(F, G) Q4_O_E1(F, G) Q4_INIT1
#define Q4_O_ENDS_3(F, G) Q4_O_E0(F, G) Q4_O_E1(F, G) Q4_O_E2(F, G) Q4_INIT2
#define Q4_O_ENDS_4(F, G) Q4_O_E0(F, G) Q4_O_E1(F, G) Q4_O_E2(F, G) Q4_O_E3(F, G) Q4_INIT2
#define Q4_O_INIT_1 Q4_INIT1
#define Q4_O_INIT_2 Q4_INIT1
#define Q4_O_INIT_3 Q4_INIT2
#define Q4_O_INIT_4 Q4_INIT2
#define Q4_O_BODY_I4(NB_) Q4_O_S##NB_(Q4_UNP_I4)
#define Q4_O_BODY_MX(NB_) Q4_O_S##NB_(Q4_UNP_MX)
#define Q4_O_BODY_B8(NB_) Q4_O8_S##NB_
#define Q4_O_ASM(NB_, F, LOOP, ST, G) \
  Q4_PAIR_ASM(Q4_O_INIT_##NB_, LOOP(Q4_O_BODY_##F(NB_)), Q4_O_ENDS_##NB_(F, G), ST, G)

// Tiles of 2-4 pairs x 1 block: the totals in memory at t (4 per pair: one ld1 and one st1 per
// pair and group, as the accumulators take v16..v31). Group end: the 8 scales into v8, v9 (as in
// the one-pair tiles, post-indexed over them), the 4 column pairs' scales dup'ed into v10-v13,
// then per pair: (int4) 2 sub, ld1 of its totals, per column pair scvtf, fmul, fadd, st1.
#define Q4_M_SC_I4 "ldp q8, q9, [%[b]], " Q4_SB_I4 "\n\t"
#define Q4_M_SC_B8 Q4_M_SC_I4
#define Q4_M_SC_MX \
  "ldr q8, [%[b]], " Q4_SB_MX "\n\tshll2 v9.4s, v8.8h, #16\n\tshll v8.4s, v8.4h, #16\n\t"
#define Q4_M_DUP \
  "dup v10.2d, v8.d[0]\n\tdup v11.2d, v8.d[1]\n\tdup v12.2d, v9.d[0]\n\tdup v13.2d, v9.d[1]\n\t"
#define Q4_M_ACC(CV, G, x, t, sc)                                                           \
  CV(x) "fmul " x ".4s, " x ".4s, " sc ".4s\n\t" Q4_M_GS##G(x)                              \
  "fadd " t ".4s, " t ".4s, " x ".4s\n\t"
// kGs: pair p's [a_r a_r a_r+1 a_r+1] into v4 (v4-v7 are free at the group end): row r from its
// pointer gp, row r + 1 at gp + gsx bytes (gsx: gst, or for the last pair gsl, 0 when its second
// row is padding: no read past the m rows).
#define Q4_M_GS0(x) ""
#define Q4_M_GS1(x) "fmul " x ".4s, " x ".4s, v4.4s\n\t"
#define Q4_M_GL0(gp, gsx) ""
#define Q4_M_GL1(gp, gsx)                                                                   \
  "ldr s5, [%[" gp "], %[" gsx "]]\n\tld1r {v4.2s}, [%[" gp "]], #4\n\t"                    \
  "dup v5.2s, v5.s[0]\n\tzip1 v4.2d, v4.2d, v5.2d\n\t"
#define Q4_M_PAIR(F, G, x0, x1, x2, x3, gp, gsx)                                            \
  Q4_SUB_##F(x2, x0) Q4_SUB_##F(x3, x1) Q4_M_GL##G(gp, gsx) "ld1 {v0.4s-v3.4s}, [%[t]]\n\t"  \
  Q4_M_ACC(Q4_CVL, G, x0, "v0", "v10") Q4_M_ACC(Q4_CVL, G, x1, "v1", "v11")                  \
  Q4_M_ACC(Q4_CVH_##F, G, x2, "v2", "v12") Q4_M_ACC(Q4_CVH_##F, G, x3, "v3", "v13")          \
  "st1 {v0.4s-v3.4s}, [%[t]], #64\n\t"
#define Q4_M_P0(F, G, gsx) Q4_M_PAIR(F, G, "v16", "v17", "v18", "v19", "g0", gsx)
#define Q4_M_P1(F, G, gsx) Q4_M_PAIR(F, G, "v20", "v21", "v22", "v23", "g1", gsx)
#define Q4_M_P2(F, G, gsx) Q4_M_PAIR(F, G, "v24", "v25", "v26", "v27", "g2", gsx)
#define Q4_M_P3(F, G, gsx) Q4_M_PAIR(F, G, "v28", "v29", "v30", "v31", "g3", gsx)
#define Q4_M_END2(F, G) Q4_M_P0(F, G, "gst") Q4_M_P1(F, G, "gsl")
#define Q4_M_END3(F, G) Q4_M_P0(F, G, "gst") Q4_M_P1(F, G, "gst") Q4_M_P2(F, G, "gsl")
#define Q4_M_END4(F, G) \
  Q4_M_P0(F, G, "gst") Q4_M_P1(F, G, "gst") Q4_M_P2(F, G, "gst") Q4_M_P3(F, G, "gsl")
#define Q4_GOUT_M0
#define Q4_GOUT_M1 , [g0] "+r"(g0), [g1] "+r"(g1), [g2] "+r"(g2), [g3] "+r"(g3)
#define Q4_GIN_M0
#define Q4_GIN_M1 , [gst] "r"(gst), [gsl] "r"(gsl)
#define Q4_M_Z2 "ld1 {v16.4s-v19.4s}, [%[c]], %[cs]\n\tld1 {v20.4s-v23.4s}, [%[c]], %[cs]\n\t"
#define Q4_M_Z3 Q4_M_Z2 "ld1 {v24.4s-v27.4s}, [%[c]], %[cs]\n\t"
#define Q4_M_Z4 Q4_M_Z3 "ld1 {v28.4s-v31.4s}, [%[c]], %[cs]\n\t"
#define Q4_M_BODY_I4(NP_) Q4_S##NP_##x1(Q4_UNP_I4)
#define Q4_M_BODY_MX(NP_) Q4_S##NP_##x1(Q4_UNP_MX)
#define Q4_M_BODY_B8(NP_) Q4_S8_##NP_##x1
#define Q4_M_ASM(NP_, F, LOOP, G)                                                          \
  __asm__ volatile(                                                                        \
      Q4_M_Z##NP_ "2:\n\tmov %[t], %[tb]\n\t"                                               \
      LOOP(Q4_M_BODY_##F(NP_)) Q4_M_SC_##F Q4_M_DUP Q4_M_END##NP_(F, G) Q4_M_Z##NP_  \
      "subs %[gn], %[gn], #1\n\tb.ne 2b\n\t"                                                \
      : [a] "+r"(a), [b] "+r"(b), [gn] "+r"(gn), [n] "=&r"(n), [t] "=&r"(t),                \
        [c] "+r"(c) Q4_GOUT_M##G                                                           \
      : [np2] "r"(np2), [s64] "r"(s64), [back] "r"(back), [cs] "r"(cs),                    \
        [mask] "w"(mask), [tab] "w"(tab), [tb] "r"(o) Q4_GIN_M##G                          \
      : Q4_CLOB, "v16", "v17", "v18", "v19", "v20", "v21", "v22", "v23", "v24", "v25",     \
        "v26", "v27", "v28", "v29", "v30", "v31")
#define Q4_M_FMT_G(NP_, G)                                                          \
  if constexpr (F == W4Format::mxfp4) Q4_M_ASM(NP_, MX, Q4_LOOP_G32, G);              \
  else if constexpr (F == W4Format::int8_affine && kG32) Q4_M_ASM(NP_, B8, Q4_LOOP_G32, G); \
  else if constexpr (F == W4Format::int8_affine) Q4_M_ASM(NP_, B8, Q4_LOOP, G);       \
  else if constexpr (kG32) Q4_M_ASM(NP_, I4, Q4_LOOP_G32, G);                         \
  else Q4_M_ASM(NP_, I4, Q4_LOOP, G);
#define Q4_M_FMT(NP_)                        \
  if constexpr (kGs) { Q4_M_FMT_G(NP_, 1) } \
  else { Q4_M_FMT_G(NP_, 0) }

// The fp32 totals of an NP x NB tile (one row: NB <= 4; two rows: NB <= 2; NP > 1: NB == 1)
// over all groups: a at
// the A block, b at block 0, c at the tile's start values (init_sums, or kZeros for mxfp4).
// o: kOneRow: the 8 NB sums of row 0 (block j's columns at 8 j);
// otherwise (pair p, block j)'s 4 column-pair totals [r c, r c+1, r+1 c, r+1 c+1] at
// 16 (p NB + j) (o zeroed by the caller when NP > 1). kG32: int4 groups of 32 k (one slice pair
// per group: no k loop); mxfp4 always is. kGs: gs is row 0's group scales (rows groups apart),
// rows the tile's rows that exist.
template <int NP, int NB, W4Format F, bool kOneRow, bool kG32, bool kGs>
void tile_sums(const Call& cl, const int8_t* a, const uint8_t* b, const int32_t* c, float* o,
               const float* gs, int64_t rows) {
  static_assert((NP == 1 && NB <= (kOneRow ? 4 : 2)) || (NP <= 4 && NB == 1), "no such tile");
  const int64_t bs = int64_t(cl.block_bytes), s64 = 64, back = 64 - (NB - 1) * bs;
  const int64_t b8 = bs - 64;  // 8-bit codes: from a block's slice 2t + 1 to the next block
  // The scales' bytes per group (Packing::scales_bytes: 8 fp32 or bf16), the asm's post-index
  // immediates (Q4_SB_*).
  const int64_t sb = F == W4Format::mxfp4 ? 16 : 32, bsc = bs - sb, cs = cl.init_step;
  const uint64_t np2 = uint64_t(cl.g) / 32;
  uint64_t gn = uint64_t(cl.groups), n;
  const uint8x16_t mask = vdupq_n_u8(0x0f);
  const int8x16_t tab = vld1q_s8(cl.table);
  // kGs: pair p's first row's pointer (pairs past NP: row 0, unread); its second row gst bytes
  // on, for the last pair gsl (0 when that row is padding, so it rereads the first).
  const int64_t gst = cl.groups * int64_t(sizeof(float)), gsl = rows % 2 == 0 ? gst : 0;
  const float *g0 = gs, *g1 = gs, *g2 = gs, *g3 = gs;
  if constexpr (NP == 1) {
    if (rows > 1) g1 = gs + cl.groups;  // the one-pair asm takes rows 0 and 1 as g0, g1
  } else {
    g1 = gs + 2 * cl.groups;
    if (NP > 2) g2 = gs + 4 * cl.groups;
    if (NP > 3) g3 = gs + 6 * cl.groups;
  }
  if constexpr (NP == 1) {
    const uint8_t* s;
    if constexpr (kOneRow && NB == 1) { Q4_PAIR_FMT(Q4_O_ASM, 1, Q4_ST1) }
    else if constexpr (kOneRow && NB == 2) { Q4_PAIR_FMT(Q4_O_ASM, 2, Q4_ST2) }
    else if constexpr (kOneRow && NB == 3) { Q4_PAIR_FMT(Q4_O_ASM, 3, Q4_ST3) }
    else if constexpr (kOneRow) { Q4_PAIR_FMT(Q4_O_ASM, 4, Q4_ST4) }
    else if constexpr (NB == 1) { Q4_PAIR_FMT(Q4_P1_ASM, 1, Q4_ST2) }
    else { Q4_PAIR_FMT(Q4_P1_ASM, 2, Q4_ST4) }
    (void)s;
  } else {
    float* t;
    if constexpr (NP == 2) { Q4_M_FMT(2) }
    else if constexpr (NP == 3) { Q4_M_FMT(3) }
    else { Q4_M_FMT(4) }
    (void)t;
    (void)bsc;
  }
  (void)n;
  (void)np2;
  (void)b8;
  (void)g0, (void)g1, (void)g2, (void)g3, (void)gsl;
}

// One tile: NP row pairs (rows valid rows, NP = (rows + 1) / 2; kOneRow: rows == 1) x NB blocks
// (full or padded) over all groups. a: row pair 0's slice 0 (an A block start); b: block 0; out:
// row 0, column 0 of the tile; c: the row tile's start values; nc: columns of the tile's last
// block inside n (1..8).
template <int NP, int NB, W4Format F, bool kOneRow, bool kG32, bool kGs>
void tile(const Call& cl, const int8_t* a, const uint8_t* b, const int32_t* c, float* out,
          int64_t stride,
          int64_t rows, int64_t nc, const float* ls, const float* bias, const float* gs) {
  static_assert(!kOneRow || NP == 1, "one-row tiles have one row pair");
  alignas(16) float sums[16 * NP * NB] = {};
  tile_sums<NP, NB, F, kOneRow, kG32, kGs>(cl, a, b, c, sums, gs, rows);
  for (int j = 0; j < NB; ++j) {
    const int64_t jc = j == NB - 1 ? nc : kNr;
    const float* bj = bias != nullptr ? bias + j * kNr : nullptr;
    float* oj = out + j * kNr;
    if constexpr (kOneRow) {
      store_q4_row8(oj, vld1q_f32(sums + 8 * j), vld1q_f32(sums + 8 * j + 4), jc, ls[0], bj);
    } else {
      for (int p = 0; p < NP; ++p) {
        const float* t = sums + 16 * (p * NB + j);
        const auto pr = [&](int c) { return vld1q_f64(reinterpret_cast<const double*>(t + 4 * c)); };
        // Row 2p: the low halves of the column pairs; row 2p + 1: the high halves.
        store_q4_row8(oj + 2 * p * stride, vreinterpretq_f32_f64(vzip1q_f64(pr(0), pr(1))),
                      vreinterpretq_f32_f64(vzip1q_f64(pr(2), pr(3))), jc, ls[2 * p], bj);
        if (2 * p + 1 < rows)
          store_q4_row8(oj + (2 * p + 1) * stride, vreinterpretq_f32_f64(vzip2q_f64(pr(0), pr(1))),
                        vreinterpretq_f32_f64(vzip2q_f64(pr(2), pr(3))), jc, ls[2 * p + 1], bj);
      }
    }
  }
}

// Blocks [jb, jb + nb) of the row tile at A block `a` (rows valid rows; c: its start values):
// tiles of NB blocks, then the rest with NB - 1, ... 1.
template <int NP, int NB, W4Format F, bool kOneRow, bool kG32, bool kGs>
void blocks(const Call& cl, const int8_t* a, const int32_t* c, const uint8_t* b, int64_t jb,
            int64_t nb, int64_t n, float* d, int64_t stride, int64_t rows, const float* ls,
            const float* bias, const float* gs) {
  for (; nb >= NB; nb -= NB, jb += NB) {
    const int64_t j0 = jb * kNr;
    const int64_t nc = std::min<int64_t>(kNr, n - (j0 + (NB - 1) * kNr));
    tile<NP, NB, F, kOneRow, kG32, kGs>(cl, a, b + size_t(jb) * cl.block_bytes, c, d + j0, stride,
                                        rows, nc, ls, bias != nullptr ? bias + j0 : nullptr, gs);
  }
  if constexpr (NB > 1) {
    if (nb > 0)
      blocks<NP, NB - 1, F, kOneRow, kG32, kGs>(cl, a, c, b, jb, nb, n, d, stride, rows, ls, bias,
                                                gs);
  }
}

template <W4Format F, bool kG32, bool kGs>
void row_tile(const Call& cl, const int8_t* a, const int32_t* c, const uint8_t* b, int64_t jb,
              int64_t nb, int64_t n, float* d, int64_t stride, int64_t rows, const float* ls,
              const float* bias, const float* gs) {
#define Q4_BLOCKS(NP_, NB_, ONE) \
  blocks<NP_, NB_, F, ONE, kG32, kGs>(cl, a, c, b, jb, nb, n, d, stride, rows, ls, bias, gs)
  switch ((rows + 1) / 2) {
    case 4: Q4_BLOCKS(4, 1, false); break;
    case 3: Q4_BLOCKS(3, 1, false); break;
    case 2: Q4_BLOCKS(2, 1, false); break;
    default:
      if (rows == 1) Q4_BLOCKS(1, 4, true);
      else Q4_BLOCKS(1, 2, false);
      break;
  }
#undef Q4_BLOCKS
}

// kGs: with ep.lhs_group_scale.
template <W4Format F, bool kG32, bool kGs>
void run(int64_t m, int64_t n, int64_t k, const W4Layout& w, const void* lhs, const void* rhs,
         float* dst, int64_t stride, const Q4GemmEpilogue& ep) {
  constexpr bool kInt4 = F == W4Format::int4;
  const auto* a = static_cast<const int8_t*>(lhs);
  const auto* b = static_cast<const uint8_t*>(rhs);
  const int64_t groups = k / w.group;
  // 8-bit codes have no table (the asm's tab operand is then unused zeros).
  const int8_t* table = F == W4Format::int8_affine ? reinterpret_cast<const int8_t*>(kZeros)
                                                   : w4_decode_table(w.format);
  const Call cl{w.group, groups, Packing::block_bytes(k, w), table, kInt4 ? 64 : 0};
  const int32_t* init = kInt4 ? init_sums(m, k, w.group, a, ep.scratch) : kZeros;
  const int64_t nblocks = (n + kNr - 1) / kNr;
  const int64_t step = m <= kMr ? nblocks : kStepBlocks;
  for (int64_t jb = 0; jb < nblocks; jb += step) {
    const int64_t nb = std::min(step, nblocks - jb);
    for (int64_t i0 = 0; i0 < m; i0 += kMr)
      row_tile<F, kG32, kGs>(cl, a + i0 * k, kInt4 ? init + (i0 / kMr) * groups * 64 : init, b, jb,
                             nb, n, dst + i0 * stride, stride, std::min(kMr, m - i0),
                             ep.lhs_scale + i0, ep.bias,
                             kGs ? ep.lhs_group_scale + i0 * groups : nullptr);
  }
}

// The int4 and 8-bit loops (F), with or without the k loop.
template <W4Format F, bool kGs>
void run_g(int64_t m, int64_t n, int64_t k, const W4Layout& w, const void* lhs, const void* rhs,
           float* dst, int64_t stride, const Q4GemmEpilogue& ep) {
  if (w.group == 32) run<F, true, kGs>(m, n, k, w, lhs, rhs, dst, stride, ep);
  else run<F, false, kGs>(m, n, k, w, lhs, rhs, dst, stride, ep);
}

}  // namespace

extern const Q4GemmUkernel q4gemm_qs8p8x8_q4cpo8x8_8x8_neon_i8mm =
    make_q4gemm<LhsPacking, Packing>("q4gemm_qs8p8x8_q4cpo8x8_8x8_neon_i8mm", Isa::neon_i8mm, kMr,
                                     pack_lhs, pack_rhs_q4<Packing, PairNibbles, OffsetLowInt4>,
                                     q4_run_f32<run_g<W4Format::int4, false>,
                                                run<W4Format::mxfp4, true, false>,
                                                run_g<W4Format::int8_affine, false>,
                                                run_g<W4Format::int4, true>,
                                                run<W4Format::mxfp4, true, true>,
                                                run_g<W4Format::int8_affine, true>>,
                                     scratch_bytes);

}  // namespace cpumoe
