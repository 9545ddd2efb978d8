// q4gemm_bf16p2x4_q4cp8x4_4x8_neon_bf16: the W4A8 GEMM on BFMMLA, for CPUs with FEAT_BF16 but
// without FEAT_I8MM, exact as the int8 family's BFMMLA kernel is.
//
// A is that kernel's `bf16p2x4` (its packer: the int8 activations converted to bf16, exact; row
// pairs interleaved in 4-k slices, 16 bytes per slice). B (`q4cp8x4`): blocks of 8 columns
// (Q4Packing<8>: per group the codes, 4 g bytes, then the 8 scales); for 4-k slice s (16 bytes at
// s * 16) the code of column c, k 4s + e sits at byte (c / 2 % 2) * 8 + (c % 2) * 4 + e, in the
// low nibble for column pairs 0, 1 and in the high nibble for column pairs 2, 3. So one 16-byte
// load holds a slice's four BFMMLA operands (column pair c: column 2c's 4 k, then 2c + 1's): the
// nibbles as indices (`and #0xf` / `ushr #4`), two tbl lookups give the low and the high bytes of
// the bf16 values of the format's table (a small integer: exact in bf16), and zip1 / zip2 put
// them together: 10 instructions for 4 operands.
// int8_affine's 8-bit codes (Q4GemmUkernel::codes8; Q4Packing<8, 1, SignedBytes<ColumnSlices4>>:
// per group 8 g bytes, then the 8 fp32 scales) are stored as the int8 values v = c - 128, per
// 4-k slice s 32 bytes at s * 32, column c's 4 k at 4 c: one 32-byte load, two registers
// (columns 0-3, 4-7), whose 32-bit lanes are the columns. Widening to bf16, per column pair: two
// tbl (column c's 4 bytes to the top bytes of 4 int32 lanes, zeros below: v * 2^24), two
// `scvtf #24` (fp32 v, exact) and one uzp2 .8h of the high halves (bf16 v, exact: at most 8
// significant bits, so the low halves are zero): 20 instructions for 4 operands, no offsets
// (the accumulators start at zero).
//
// Exactness: BFMMLA sums a group in fp32, but every partial sum is an integer of magnitude below
// g * 128 * 12 <= 2^24 for g <= 8192 (8-bit codes: g * 128 * 128 <= 2^24 for g <= 1024), so it is
// exact whatever BFMMLA's internal rounding, and at the group end the fp32 accumulator is
// float(isum) itself: one fmul by the group's scales ([s_c s_c+1 s_c s_c+1], a dup .d of the 8
// scales) and one fadd into the totals, the oracle's acc + float(isum) * s in g order, no FMA.
// Groups longer than 8192 k (int4; 1024 k for 8-bit codes; mxfp4's are 32) sum pieces of that
// many k in fp32, convert each to int32 (exact) and add them in int32 (long_groups()): the int32
// group sum is exact (|isum| <= 128 * 128 * 65536 = 2^30 up to kW4MaxGroup).
// With Q4GemmEpilogue::lhs_group_scale, variants of the loops (template flag kGs, so the plain
// ones are unchanged) build per group and row pair [a_r a_r a_r+1 a_r+1] of the rows' group
// scales (two ld1r and a zip1) and multiply each scaled product by it before the fadd: the
// oracle's (float(isum) * s) * a.
//
// Tiles, all groups in one asm: 1 row pair x 2 blocks (decode), 2 pairs x 1 block (4 rows: each
// decoded operand feeds 2 BFMMLA), 1 x 1 for a last block; per (pair, column pair) one BFMMLA
// accumulator for the group (v16..v23) and one fp32 total (v24..v31). Walk: blocks outer, row
// tiles inner (a block's packed B, 4 k (8-bit codes: 8 k) + 32 bytes per group, stays in L1
// across the row tiles).
// @pre m, n >= 0, k % group == 0, group % 32 == 0; packed buffers from this kernel's packers.
// Features used: NEON, BF16 (BFMMLA; the 8-bit codes' widening uses plain NEON).
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#error "q4gemm_bf16p2x4_q4cp8x4_4x8_neon_bf16.cpp needs -march=armv8.2-a+bf16 (set per file by CMake)"
#endif

#include <arm_neon.h>

#include <algorithm>

#include "cpumoe/q4gemm.h"
#include "ukernels/common/arm/neon_bf16_common.h"
#include "ukernels/q4gemm/arm/q4gemm_arm_common.h"
#include "ukernels/q4gemm/q4gemm_common.h"

namespace cpumoe {
namespace {

constexpr int64_t kMr = 4;
constexpr int64_t kNr = 8;
constexpr int64_t kExactK = 8192;  // the longest k run whose fp32 partial sums are exact
static_assert(kExactK * 128 * 12 <= (int64_t(1) << 24), "fp32 partial sums must be exact");
constexpr int64_t kExactK8 = 1024;  // the same for 8-bit codes (values down to -128)
static_assert(kExactK8 * 128 * 128 <= (int64_t(1) << 24), "fp32 partial sums must be exact");
// The longest group (or piece of one) the asm sums in fp32 for format F.
template <W4Format F>
constexpr int64_t exact_k() {
  return F == W4Format::int8_affine ? kExactK8 : kExactK;
}
// A as the int8 BFMMLA kernel packs it (bf16 row pairs; kp = k here).
using LhsPacking = QGemmPacking<kNr, kBf16pKr, 2, 2, 2>;

// Nibble position of column c's code kk of a group (see the file comment).
struct PairSlices4 {
  static int64_t index(int64_t c, int64_t kk, int64_t /*g*/) {
    const int64_t cp = c / 2;
    const int64_t byte = (kk / 4) * 16 + (cp % 2) * 8 + (c % 2) * 4 + kk % 4;
    return 2 * byte + cp / 2;
  }
};
// Byte position of column c's 8-bit code kk of a group: 4-k slice s at 32 s, column c's 4 k at
// 4 c (see the file comment).
struct ColumnSlices4 {
  static int64_t index(int64_t c, int64_t kk, int64_t /*g*/) {
    return (kk / 4) * 32 + c * 4 + kk % 4;
  }
};
using Packing = Q4Packing<kNr, 1, SignedBytes<ColumnSlices4>>;

// The tbl indices of the 8-bit widening, column c % 4 at 16 c: lane l's top byte from byte
// 4 c + l of the register, the three below out of range (0).
alignas(16) constexpr uint8_t kB8Index[64] = {
    0xff, 0xff, 0xff, 0,  0xff, 0xff, 0xff, 1,  0xff, 0xff, 0xff, 2,  0xff, 0xff, 0xff, 3,
    0xff, 0xff, 0xff, 4,  0xff, 0xff, 0xff, 5,  0xff, 0xff, 0xff, 6,  0xff, 0xff, 0xff, 7,
    0xff, 0xff, 0xff, 8,  0xff, 0xff, 0xff, 9,  0xff, 0xff, 0xff, 10, 0xff, 0xff, 0xff, 11,
    0xff, 0xff, 0xff, 12, 0xff, 0xff, 0xff, 13, 0xff, 0xff, 0xff, 14, 0xff, 0xff, 0xff, 15};

// The low and high bytes of the bf16 values of a format's 16 codes (the high half of the fp32).
struct Bf16Table {
  uint8x16_t lo, hi;
  explicit Bf16Table(const int8_t* t) {
    const int16x8_t w0 = vmovl_s8(vld1_s8(t)), w1 = vmovl_s8(vld1_s8(t + 8));
    const auto bf = [](int16x8_t w) {
      const float32x4_t a = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
      const float32x4_t b = vcvtq_f32_s32(vmovl_high_s16(w));
      return vuzp2q_u16(vreinterpretq_u16_f32(a), vreinterpretq_u16_f32(b));
    };
    const uint8x16_t b0 = vreinterpretq_u8_u16(bf(w0)), b1 = vreinterpretq_u8_u16(bf(w1));
    lo = vuzp1q_u8(b0, b1);
    hi = vuzp2q_u8(b0, b1);
  }
};

// --- The tile asm ------------------------------------------------------------------------------
// Scratch: A pairs in v0, v1; a slice's codes in v2, the indices in v3, the looked-up bytes in v4
// (low) and v5 (high), the 4 operands in v6-v9; mxfp4's scale constants in v10 (2^-127) and v11
// (0.5); at a group end the 8 scales in v12 (columns 0-3) and v2 (4-7), the dup'ed pair scales in
// v3, v4, and (kGs) pair p's group scales in v(p), as its accumulators' lanes. Mask and tables are
// operands (v13-v15); the 8-bit loops (Q4B8_*) use v0-v15 as below instead. Accumulator
// i = (p * NB + j) * 4 + c in X(i).
#define Q4B_DEC                                                                                \
  "and v3.16b, v2.16b, %[mask].16b\n\ttbl v4.16b, {%[tl].16b}, v3.16b\n\t"                     \
  "tbl v5.16b, {%[th].16b}, v3.16b\n\tzip1 v6.16b, v4.16b, v5.16b\n\tzip2 v7.16b, v4.16b, v5.16b\n\t" \
  "ushr v3.16b, v2.16b, #4\n\ttbl v4.16b, {%[tl].16b}, v3.16b\n\t"                             \
  "tbl v5.16b, {%[th].16b}, v3.16b\n\tzip1 v8.16b, v4.16b, v5.16b\n\tzip2 v9.16b, v4.16b, v5.16b\n\t"
#define Q4B_MM(acc, a, b) "bfmmla " acc ".4s, " a ".8h, " b ".8h\n\t"
#define Q4B_LDB(step) "ld1 {v2.16b}, [%[b]], %[" #step "]\n\t"
#define Q4B_BLK1(X, i0, i1, i2, i3) \
  Q4B_DEC Q4B_MM(X(i0), "v0", "v6") Q4B_MM(X(i1), "v0", "v7") Q4B_MM(X(i2), "v0", "v8") \
      Q4B_MM(X(i3), "v0", "v9")
#define Q4B_LDA1 "ldr q0, [%[a0]], #16\n\t"
#define Q4B_S1x1(X) Q4B_LDA1 Q4B_LDB(back) Q4B_BLK1(X, 0, 1, 2, 3)
#define Q4B_S1x2(X) Q4B_LDA1 Q4B_LDB(bs) Q4B_BLK1(X, 0, 1, 2, 3) Q4B_LDB(back) Q4B_BLK1(X, 4, 5, 6, 7)
#define Q4B_S2x1(X)                                                                         \
  Q4B_LDA1 "ldr q1, [%[a1]], #16\n\t" Q4B_LDB(back) Q4B_DEC Q4B_MM(X(0), "v0", "v6")        \
      Q4B_MM(X(4), "v1", "v6") Q4B_MM(X(1), "v0", "v7") Q4B_MM(X(5), "v1", "v7")             \
          Q4B_MM(X(2), "v0", "v8") Q4B_MM(X(6), "v1", "v8") Q4B_MM(X(3), "v0", "v9")         \
              Q4B_MM(X(7), "v1", "v9")
// 8-bit codes (B8): a slice's 32 code bytes in v2 (columns 0-3) and v3 (4-7); per column pair two
// tbl (indices kB8Index in v10, v11, v13, v14: column c's 4 codes to the top bytes of 4 int32
// lanes, v * 2^24), two scvtf #24 (fp32 v, exact) and one uzp2 of the high halves (bf16 v: at
// most 8 significant bits, exact) into its operand (v6-v9), temporaries v4, v5, v12, v15.
#define Q4B8_CP(src, ia, ib, t0, t1, op)                                                       \
  "tbl " t0 ".16b, {" src ".16b}, " ia ".16b\n\ttbl " t1 ".16b, {" src ".16b}, " ib ".16b\n\t" \
  "scvtf " t0 ".4s, " t0 ".4s, #24\n\tscvtf " t1 ".4s, " t1 ".4s, #24\n\t"                    \
  "uzp2 " op ".8h, " t0 ".8h, " t1 ".8h\n\t"
#define Q4B8_DEC                                                                              \
  Q4B8_CP("v2", "v10", "v11", "v4", "v5", "v6") Q4B8_CP("v2", "v13", "v14", "v12", "v15", "v7") \
      Q4B8_CP("v3", "v10", "v11", "v4", "v5", "v8")                                           \
          Q4B8_CP("v3", "v13", "v14", "v12", "v15", "v9")
#define Q4B8_IX "ldp q10, q11, [%[ix]]\n\tldp q13, q14, [%[ix], #32]\n\t"
#define Q4B8_LDB(step) "ld1 {v2.16b-v3.16b}, [%[b]], %[" #step "]\n\t"
#define Q4B8_BLK1(X, i0, i1, i2, i3) \
  Q4B8_DEC Q4B_MM(X(i0), "v0", "v6") Q4B_MM(X(i1), "v0", "v7") Q4B_MM(X(i2), "v0", "v8") \
      Q4B_MM(X(i3), "v0", "v9")
#define Q4B8_S1x1(X) Q4B_LDA1 Q4B8_LDB(back) Q4B8_BLK1(X, 0, 1, 2, 3)
#define Q4B8_S1x2(X) \
  Q4B_LDA1 Q4B8_LDB(bs) Q4B8_BLK1(X, 0, 1, 2, 3) Q4B8_LDB(back) Q4B8_BLK1(X, 4, 5, 6, 7)
#define Q4B8_S2x1(X)                                                                        \
  Q4B_LDA1 "ldr q1, [%[a1]], #16\n\t" Q4B8_LDB(back) Q4B8_DEC Q4B_MM(X(0), "v0", "v6")       \
      Q4B_MM(X(4), "v1", "v6") Q4B_MM(X(1), "v0", "v7") Q4B_MM(X(5), "v1", "v7")             \
          Q4B_MM(X(2), "v0", "v8") Q4B_MM(X(6), "v1", "v8") Q4B_MM(X(3), "v0", "v9")         \
              Q4B_MM(X(7), "v1", "v9")
#define Q4B8_CLOB                                                                            \
  "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11", "v12", "v13", "v14", \
      "v15", "cc", "memory"
#define Q4B_V(i) Q4B_V_##i
#define Q4B_V_0 "v16"
#define Q4B_V_1 "v17"
#define Q4B_V_2 "v18"
#define Q4B_V_3 "v19"
#define Q4B_V_4 "v20"
#define Q4B_V_5 "v21"
#define Q4B_V_6 "v22"
#define Q4B_V_7 "v23"
#define Q4B_O(i) "%[x" #i "]"
// Group end of one block: scales (SC) into v12, v2, then per pair the 4 accumulators.
#define Q4B_SC_I4(base) "ldp q12, q2, [" base "]\n\t"
#define Q4B_SC_MX(base)                                                                    \
  "ldr d12, [" base "]\n\tushll v12.8h, v12.8b, #7\n\tshll2 v2.4s, v12.8h, #16\n\t"        \
  "shll v12.4s, v12.4h, #16\n\tumax v12.4s, v12.4s, v10.4s\n\tumax v2.4s, v2.4s, v10.4s\n\t" \
  "fmul v5.4s, v12.4s, v11.4s\n\tfmul v6.4s, v2.4s, v11.4s\n\t"                            \
  "fsub v12.4s, v12.4s, v5.4s\n\tfsub v2.4s, v2.4s, v6.4s\n\t"
// acc * sc (then, G = 1, * the pair's group scales ga) into tot.
#define Q4B_FA0(acc, tot, sc, ga) \
  "fmul " acc ".4s, " acc ".4s, " sc ".4s\n\tfadd " tot ".4s, " tot ".4s, " acc ".4s\n\t"
#define Q4B_FA1(acc, tot, sc, ga)                                                         \
  "fmul " acc ".4s, " acc ".4s, " sc ".4s\n\tfmul " acc ".4s, " acc ".4s, " ga ".4s\n\t"    \
  "fadd " tot ".4s, " tot ".4s, " acc ".4s\n\t"
#define Q4B_END1(G, a0, a1, a2, a3, t0, t1, t2, t3)                                      \
  "dup v3.2d, v12.d[0]\n\tdup v4.2d, v12.d[1]\n\t"                                         \
  Q4B_FA##G(a0, t0, "v3", "v0") Q4B_FA##G(a1, t1, "v4", "v0")                             \
  "dup v3.2d, v2.d[0]\n\tdup v4.2d, v2.d[1]\n\t"                                           \
  Q4B_FA##G(a2, t2, "v3", "v0") Q4B_FA##G(a3, t3, "v4", "v0")
#define Q4B_END2(SC, G)                                                                     \
  SC("%[b]") Q4B_GL2_##G "dup v3.2d, v12.d[0]\n\tdup v4.2d, v12.d[1]\n\t"                    \
  Q4B_FA##G("v16", "v24", "v3", "v0") Q4B_FA##G("v17", "v25", "v4", "v0")                   \
  Q4B_FA##G("v20", "v28", "v3", "v1") Q4B_FA##G("v21", "v29", "v4", "v1")                   \
  "dup v3.2d, v2.d[0]\n\tdup v4.2d, v2.d[1]\n\t"                                             \
  Q4B_FA##G("v18", "v26", "v3", "v0") Q4B_FA##G("v19", "v27", "v4", "v0")                   \
  Q4B_FA##G("v22", "v30", "v3", "v1") Q4B_FA##G("v23", "v31", "v4", "v1")
#define Q4B_ENDS_1x1(SC, G) \
  SC("%[b]") Q4B_GL1_##G Q4B_END1(G, "v16", "v17", "v18", "v19", "v24", "v25", "v26", "v27")
#define Q4B_ENDS_1x2(SC, G)                                                                 \
  Q4B_ENDS_1x1(SC, G) "add %[s], %[b], %[bs]\n\t" SC("%[s]")                                \
  Q4B_END1(G, "v20", "v21", "v22", "v23", "v28", "v29", "v30", "v31")
#define Q4B_ENDS_2x1(SC, G) Q4B_END2(SC, G)
// kGs: pair 0's group scales [a0 a0 a1 a1] into v0 (pair 1's into v1: rows g2, g3), after SC
// (whose mxfp4 decode uses v5). The pointers step one float per group; a padded row's points at
// its pair's other row.
#define Q4B_GL(v, ga, gb) \
  "ld1r {" v ".2s}, [%[" ga "]], #4\n\tld1r {v5.2s}, [%[" gb "]], #4\n\tzip1 " v ".2d, " v ".2d, v5.2d\n\t"
#define Q4B_GL1_0 ""
#define Q4B_GL2_0 ""
#define Q4B_GL1_1 Q4B_GL("v0", "g0", "g1")
#define Q4B_GL2_1 Q4B_GL1_1 Q4B_GL("v1", "g2", "g3")
#define Q4B_GOPS_0
#define Q4B_GOPS_1 , [g0] "+r"(g0), [g1] "+r"(g1), [g2] "+r"(g2), [g3] "+r"(g3)
#define Q4B_INIT_I4 ""
#define Q4B_INIT_MX "movi v10.4s, #0x40, lsl #16\n\tfmov v11.4s, #0.5\n\t"
#define Q4B_Z "ld1 {v16.4s-v19.4s}, [%[z]]\n\tld1 {v20.4s-v23.4s}, [%[z]]\n\t"
#define Q4B_CLOB \
  "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11", "v12", "cc", "memory"
// The tile loop over codes whose steps are STEP##SHAPE (Q4B_S: 4-bit, Q4B8_S: 8-bit), INIT the
// constants it loads, SC the group end's scale load, IN its vector inputs, CLOB its clobbers.
#define Q4B_LOOP(STEP, SHAPE, SC, INIT, G, IN, CLOB)                                         \
  __asm__ volatile(                                                                         \
      Q4B_Z "ld1 {v24.4s-v27.4s}, [%[z]]\n\tld1 {v28.4s-v31.4s}, [%[z]]\n\t" INIT           \
      "2:\n\tmov %[n], %[ns2]\n\t"                                                          \
      "1:\n\t" STEP##SHAPE(Q4B_V) STEP##SHAPE(Q4B_V) "subs %[n], %[n], #1\n\tb.ne 1b\n\t"   \
      Q4B_ENDS_##SHAPE(SC, G) "add %[b], %[b], %[sb]\n\t" Q4B_Z                            \
      "subs %[gn], %[gn], #1\n\tb.ne 2b\n\t"                                                \
      "st1 {v24.4s-v27.4s}, [%[o]], #64\n\tst1 {v28.4s-v31.4s}, [%[o]]\n\t"                 \
      : [a0] "+r"(a0), [a1] "+r"(a1), [b] "+r"(b), [gn] "+r"(gn), [n] "=&r"(n),             \
        [s] "=&r"(s), [o] "+r"(o) Q4B_GOPS_##G                                              \
      : [ns2] "r"(ns2), [bs] "r"(bs), [back] "r"(back), [sb] "r"(sb), IN, [z] "r"(kZeros)   \
      : CLOB, "v16", "v17", "v18", "v19", "v20", "v21", "v22", "v23", "v24", "v25", "v26",  \
        "v27", "v28", "v29", "v30", "v31")
#define Q4B_IN4 [mask] "w"(mask), [tl] "w"(tl), [th] "w"(th)
#define Q4B_ASM(SHAPE, SC, INIT, G) Q4B_LOOP(Q4B_S, SHAPE, SC, INIT, G, Q4B_IN4, Q4B_CLOB)
// The same over 8-bit codes: the indices instead of mask and tables, int4's group end.
#define Q4B_IN8 [ix] "r"(kB8Index)
#define Q4B8_ASM(SHAPE, G) Q4B_LOOP(Q4B8_S, SHAPE, Q4B_SC_I4, Q4B8_IX, G, Q4B_IN8, Q4B8_CLOB)

// What a tile needs of the call.
struct Call {
  int64_t k, g;
  int64_t group_bytes, codes_bytes;
  int64_t block_bytes;
  Bf16Table tab;
};

// The fp32 totals of an NP x NB tile (g <= exact_k<F>()): A pair 0 at a (pairs 4 k bytes apart), B
// block 0 at b (blocks block_bytes apart). o: accumulator i = (p * NB + j) * 4 + c at o + 4 i,
// lanes [r0 c, r0 c+1, r1 c, r1 c+1] of column pair c. kGs: gr[r] is row r's group scales.
template <int NP, int NB, W4Format F, bool kGs>
void tile_sums(const Call& cl, const uint8_t* a, const uint8_t* b, float* o,
               const float* const* gr) {
  const uint8_t *a0 = a, *a1 = NP > 1 ? a + 4 * cl.k : a;
  uint64_t gn = uint64_t(cl.k / cl.g), n;
  const uint64_t ns2 = uint64_t(cl.g) / 8;  // two 4-k slices per iteration
  // A slice's code bytes per block: 16 (4-bit), 32 (8-bit).
  const int64_t bs = cl.block_bytes, back = (F == W4Format::int8_affine ? 32 : 16) - (NB - 1) * bs;
  const int64_t sb = cl.group_bytes - cl.codes_bytes;
  const uint8x16_t mask = vdupq_n_u8(0x0f), tl = cl.tab.lo, th = cl.tab.hi;
  const uint8_t* s;
  if constexpr (kGs) {
    const float *g0 = gr[0], *g1 = gr[1], *g2 = gr[2], *g3 = gr[3];
    if constexpr (F == W4Format::int8_affine) {
      if constexpr (NP == 2) Q4B8_ASM(2x1, 1);
      else if constexpr (NB == 2) Q4B8_ASM(1x2, 1);
      else Q4B8_ASM(1x1, 1);
    } else if constexpr (F == W4Format::int4) {
      if constexpr (NP == 2) Q4B_ASM(2x1, Q4B_SC_I4, Q4B_INIT_I4, 1);
      else if constexpr (NB == 2) Q4B_ASM(1x2, Q4B_SC_I4, Q4B_INIT_I4, 1);
      else Q4B_ASM(1x1, Q4B_SC_I4, Q4B_INIT_I4, 1);
    } else {
      if constexpr (NP == 2) Q4B_ASM(2x1, Q4B_SC_MX, Q4B_INIT_MX, 1);
      else if constexpr (NB == 2) Q4B_ASM(1x2, Q4B_SC_MX, Q4B_INIT_MX, 1);
      else Q4B_ASM(1x1, Q4B_SC_MX, Q4B_INIT_MX, 1);
    }
  } else {
    if constexpr (F == W4Format::int8_affine) {
      if constexpr (NP == 2) Q4B8_ASM(2x1, 0);
      else if constexpr (NB == 2) Q4B8_ASM(1x2, 0);
      else Q4B8_ASM(1x1, 0);
    } else if constexpr (F == W4Format::int4) {
      if constexpr (NP == 2) Q4B_ASM(2x1, Q4B_SC_I4, Q4B_INIT_I4, 0);
      else if constexpr (NB == 2) Q4B_ASM(1x2, Q4B_SC_I4, Q4B_INIT_I4, 0);
      else Q4B_ASM(1x1, Q4B_SC_I4, Q4B_INIT_I4, 0);
    } else {
      if constexpr (NP == 2) Q4B_ASM(2x1, Q4B_SC_MX, Q4B_INIT_MX, 0);
      else if constexpr (NB == 2) Q4B_ASM(1x2, Q4B_SC_MX, Q4B_INIT_MX, 0);
      else Q4B_ASM(1x1, Q4B_SC_MX, Q4B_INIT_MX, 0);
    }
    (void)gr;
  }
  (void)n;
  (void)s;
  (void)mask, (void)tl, (void)th;
}

// Groups longer than exact_k<F>() (int4, 8-bit codes): one pair x one block, the group in pieces
// of at most that many k (BFMMLA's exact fp32 sums, in asm), each converted to int32 and added;
// then the group end as in the asm (float(isum) * scales, kGs: then * [a0 a0 a1 a1] of the pair's
// rows' group scales at ga0, ga1, added to the totals). Same output as tile_sums.
template <W4Format F, bool kGs>
void long_groups(const Call& cl, const uint8_t* a, const uint8_t* b, float* o, const float* ga0,
                 const float* ga1) {
  constexpr int64_t kPiece = exact_k<F>();
  const uint8_t* a0 = a;
  const int64_t back = F == W4Format::int8_affine ? 32 : 16;
  const uint8x16_t mask = vdupq_n_u8(0x0f), tl = cl.tab.lo, th = cl.tab.hi;
  float32x4_t tot[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f),
                        vdupq_n_f32(0.0f)};
  for (int64_t g0 = 0; g0 < cl.k; g0 += cl.g) {
    int32x4_t isum[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int64_t k0 = 0; k0 < cl.g; k0 += kPiece) {
      float32x4_t x[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f),
                          vdupq_n_f32(0.0f)};
      uint64_t n = uint64_t(std::min(kPiece, cl.g - k0)) / 4;
      if constexpr (F == W4Format::int8_affine)
        __asm__ volatile(Q4B8_IX "1:\n\t" Q4B8_S1x1(Q4B_O) "subs %[n], %[n], #1\n\tb.ne 1b\n\t"
                         : [a0] "+r"(a0), [b] "+r"(b), [n] "+r"(n), [x0] "+w"(x[0]),
                           [x1] "+w"(x[1]), [x2] "+w"(x[2]), [x3] "+w"(x[3])
                         : [back] "r"(back), [ix] "r"(kB8Index)
                         : Q4B8_CLOB);
      else
        __asm__ volatile("1:\n\t" Q4B_S1x1(Q4B_O) "subs %[n], %[n], #1\n\tb.ne 1b\n\t"
                         : [a0] "+r"(a0), [b] "+r"(b), [n] "+r"(n), [x0] "+w"(x[0]),
                           [x1] "+w"(x[1]), [x2] "+w"(x[2]), [x3] "+w"(x[3])
                         : [back] "r"(back), [mask] "w"(mask), [tl] "w"(tl), [th] "w"(th)
                         : Q4B_CLOB);
      for (int c = 0; c < 4; ++c) isum[c] = vaddq_s32(isum[c], vcvtq_s32_f32(x[c]));
    }
    const auto* sc = reinterpret_cast<const float*>(b);  // the 8 fp32 scales
    float32x4_t ga = vdupq_n_f32(1.0f);
    if constexpr (kGs) ga = vcombine_f32(vdup_n_f32(*ga0++), vdup_n_f32(*ga1++));
    for (int c = 0; c < 4; ++c) {
      const auto* pair = reinterpret_cast<const uint64_t*>(sc + 2 * c);  // [s_c s_c+1] twice
      const float32x4_t s = vreinterpretq_f32_u64(vld1q_dup_u64(pair));
      float32x4_t term = vmulq_f32(vcvtq_f32_s32(isum[c]), s);
      if constexpr (kGs) term = vmulq_f32(term, ga);
      tot[c] = vaddq_f32(tot[c], term);
    }
    b += cl.group_bytes - cl.codes_bytes;
  }
  for (int c = 0; c < 4; ++c) vst1q_f32(o + 4 * c, tot[c]);
}

// Stores the totals of pair p, block j of a tile (as tile_sums leaves them): rows r0 (and r0 + 1
// if two), the block's first nc columns.
inline void store_pair(const float* t, float* d, int64_t stride, bool two, int64_t nc,
                       const float* ls, const float* bias) {
  const auto pr = [&](int c) { return vld1q_f64(reinterpret_cast<const double*>(t + 4 * c)); };
  store_q4_row8(d, vreinterpretq_f32_f64(vzip1q_f64(pr(0), pr(1))),
                vreinterpretq_f32_f64(vzip1q_f64(pr(2), pr(3))), nc, ls[0], bias);
  if (two)
    store_q4_row8(d + stride, vreinterpretq_f32_f64(vzip2q_f64(pr(0), pr(1))),
                  vreinterpretq_f32_f64(vzip2q_f64(pr(2), pr(3))), nc, ls[1], bias);
}

// kGs: with ep.lhs_group_scale.
template <W4Format F, bool kGs>
void run(int64_t m, int64_t n, int64_t k, const W4Layout& w, const void* lhs, const void* rhs,
         float* dst, int64_t stride, const Q4GemmEpilogue& ep) {
  const Call cl{k,
                w.group,
                Packing::group_bytes(w),
                Packing::codes_bytes(w),
                int64_t(Packing::block_bytes(k, w)),
                // 8-bit codes have no table (unused: int4's).
                Bf16Table(w4_decode_table(F == W4Format::int8_affine ? W4Format::int4 : w.format))};
  const auto* a = static_cast<const uint8_t*>(lhs);
  const auto* b = static_cast<const uint8_t*>(rhs);
  alignas(16) float t[32];
  const int64_t blocks = (n + kNr - 1) / kNr;
  const auto nc_of = [&](int64_t jb) { return std::min(kNr, n - jb * kNr); };
  const auto bias_of = [&](int64_t jb) { return ep.bias != nullptr ? ep.bias + jb * kNr : nullptr; };
  for (int64_t jb = 0; jb < blocks;) {
    // Decode (m <= 2) takes two blocks per tile; otherwise one block, row tiles of 2 pairs.
    const int64_t nb = m <= 2 && jb + 1 < blocks && cl.g <= exact_k<F>() ? 2 : 1;
    const uint8_t* bj = b + jb * cl.block_bytes;
    for (int64_t i0 = 0; i0 < m; i0 += kMr) {
      const int64_t rows = std::min(kMr, m - i0);
      const uint8_t* ai = a + i0 * 2 * cl.k;
      float* d = dst + i0 * stride + jb * kNr;
      const float* ls = ep.lhs_scale + i0;
      // kGs: the tile's rows' group scales; rows past m read the last row (a padded row of a
      // pair its first row), never past the m rows given.
      const float* gr[4] = {};
      if constexpr (kGs)
        for (int64_t r = 0; r < 4; ++r)
          gr[r] = ep.lhs_group_scale + (i0 + std::min(r, rows - 1)) * (k / cl.g);
      if (cl.g > exact_k<F>()) {
        for (int64_t p = 0; 2 * p < rows; ++p) {
          long_groups<F, kGs>(cl, ai + p * 4 * cl.k, bj, t, gr[2 * p], gr[2 * p + 1]);
          store_pair(t, d + 2 * p * stride, stride, 2 * p + 1 < rows, nc_of(jb), ls + 2 * p,
                     bias_of(jb));
        }
      } else if (rows > 2) {
        tile_sums<2, 1, F, kGs>(cl, ai, bj, t, gr);
        store_pair(t, d, stride, true, nc_of(jb), ls, bias_of(jb));
        store_pair(t + 16, d + 2 * stride, stride, rows == 4, nc_of(jb), ls + 2, bias_of(jb));
      } else if (nb == 2) {
        tile_sums<1, 2, F, kGs>(cl, ai, bj, t, gr);
        store_pair(t, d, stride, rows == 2, kNr, ls, bias_of(jb));
        store_pair(t + 16, d + kNr, stride, rows == 2, nc_of(jb + 1), ls, bias_of(jb + 1));
      } else {
        tile_sums<1, 1, F, kGs>(cl, ai, bj, t, gr);
        store_pair(t, d, stride, rows == 2, nc_of(jb), ls, bias_of(jb));
      }
    }
    jb += nb;
  }
}

}  // namespace

extern const Q4GemmUkernel q4gemm_bf16p2x4_q4cp8x4_4x8_neon_bf16 = make_q4gemm<LhsPacking, Packing>(
    "q4gemm_bf16p2x4_q4cp8x4_4x8_neon_bf16", Isa::neon_bf16, kMr, bf16p2x4_pack<FromInt8>,
    pack_rhs_q4<Packing, PairSlices4>,
    q4_run_f32<run<W4Format::int4, false>, run<W4Format::mxfp4, false>,
               run<W4Format::int8_affine, false>, run<W4Format::int4, true>,
               run<W4Format::mxfp4, true>, run<W4Format::int8_affine, true>>);

}  // namespace cpumoe
