// q4gemm_qs8r_q4ci8x4_4x8_neon_dotprod: the W4A8 GEMM on SDOT (Armv8.2 FEAT_DotProd), for CPUs
// with dotprod but without I8MM (Neoverse N1: Graviton 2, Ampere Altra).
//
// A is `qs8r` (row-major int8 rows, as the int8 dotprod kernel's: row i at i * k; k % 32 == 0, so
// no padding). B (`q4ci8x4`): blocks of 8 columns (Q4Packing<8, 1, SignedBytes<Interleaved4Bytes>>:
// per group the codes, 4 g bytes (8-bit codes: 8 g), then the 8 fp32 scales (mxfp4: E8M0 bytes));
// the 4-bit codes of a group are the int8 dotprod kernel's `qs8ci8x4` operands
// (one output column per int32 lane: column c's 4 k at 4 c) two to a byte: for 16 k (chunk t, 64
// bytes at t * 64), register q (16 bytes at 16 q) holds the 4-k group q of columns 0-3 in its low
// nibbles and of columns 4-7 in its high nibbles. The int4 low nibbles are stored offset (v + 8),
// the high ones as two's complement, so the raw byte read as int8 is 16 hi + lo + 8 and one
// `and #0x0f` makes the other operand (as in the I8MM kernel, whose file comment has the algebra):
// per 4-k group and row, Y = SDOT(r & 0x0f) = sum a lo + 8 sum a and X = SDOT(r) = 16 sum a hi + Y;
// each group's accumulators start at -8 sum a over the group (init_sums: per call, from A, into
// the call's scratch: scratch_bytes), and at the group end X - Y is 16 times columns 4-7's sums
// (scvtf #4), Y columns 0-3's. mxfp4 codes go through `and` / `ushr` + `tbl`
// (q4gemm_arm_common.h) and start from zero. int8_affine's 8-bit codes (Q4GemmUkernel::codes8)
// are those `qs8ci8x4` operands one to a byte, each stored as its int8 value c - 128 (c ^ 0x80,
// SignedBytes): for 16 k (128 bytes at t * 128), 4-k group q's columns 0-3 at 32 q and columns
// 4-7 at 32 q + 16; per 16 k two ld1 of 4 registers feed the SDOT as they are (no unpacking, no
// X - Y step), the accumulators start from zero (no init_sums, no scratch);
// |sum| <= 128 * 128 * g <= 2^30.
//
// Register tiles of R = 1..4 rows x 1 block, everything in one asm over all groups: per row two
// int32 accumulators (columns 0-3, 4-7) in v16.. and two fp32 ones in v24..; per 16 k, R loads
// of A (one q register: 4 lanes of 4 k), one ld1 of 4 code registers, 4 (int4) or 16 (mxfp4)
// unpacking instructions (8-bit codes: two ld1 of 4, none) and 8 R SDOT by element (lane q of
// the A register). At a group end, (int4: X - Y), per accumulator scvtf, fmul by the group's
// scales (the lanes are the columns: the 8 scales as stored, no shuffle), fadd: the oracle's
// acc + float(isum) * s in g order, no FMA;
// then the int32 accumulators get the next group's start values (one ld1 per row). With
// Q4GemmEpilogue::lhs_group_scale a variant of the asm (template flag kGs, so the plain one is
// unchanged) loads each row's group scale at the group end (one ldr s per row) and multiplies
// both scaled products of the row by it (fmul by element) before the fadd: the oracle's
// (float(isum) * s) * a. Walk: blocks outer, row tiles of 4 inner (a block's packed B,
// 4 k (8-bit codes: 8 k) + 32 bytes per group, stays in L1 across the row tiles); decode (m <= 4)
// reads each weight byte once per call.
// @pre m, n >= 0, k % group == 0, group % 32 == 0, group <= kW4MaxGroup (|X| <= g * 128 * 136
//      fits int32; 8-bit codes g * 128 * 128); packed buffers from this kernel's packers.
// Features used: NEON, DotProd (SDOT).
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_DOTPROD)
#error "q4gemm_qs8r_q4ci8x4_4x8_neon_dotprod.cpp needs -march=armv8.2-a+dotprod (set per file by CMake)"
#endif

#include <arm_neon.h>

#include <algorithm>

#include "cpumoe/q4gemm.h"
#include "ukernels/q4gemm/arm/q4gemm_arm_common.h"
#include "ukernels/q4gemm/q4gemm_common.h"

namespace cpumoe {
namespace {

constexpr int64_t kMr = 4;
constexpr int64_t kNr = 8;
using LhsPacking = QGemmPacking<kNr, 16>;  // the int8 dotprod kernel's qs8r (kp = k here)

// Nibble position of column c's code kk of a group (see the file comment).
struct Interleaved4 {
  static int64_t index(int64_t c, int64_t kk, int64_t /*g*/) {
    const int64_t byte = (kk / 16) * 64 + (kk % 16 / 4) * 16 + (c % 4) * 4 + kk % 4;
    return 2 * byte + c / 4;
  }
};
// Byte position of column c's 8-bit code kk: per 16 k (128 bytes), 4-k group q's `qs8ci8x4`
// operands of columns 0-3 at 32 q and of columns 4-7 at 32 q + 16 (see the file comment).
struct Interleaved4Bytes {
  static int64_t index(int64_t c, int64_t kk, int64_t /*g*/) {
    return (kk / 16) * 128 + (kk % 16 / 4) * 32 + (c / 4) * 16 + (c % 4) * 4 + kk % 4;
  }
};
using Packing = Q4Packing<kNr, 1, SignedBytes<Interleaved4Bytes>>;

// The int4 accumulators' start values of the m rows of A (row-major, k apart): row i's group gi
// at int32 (i * groups + gi) * 8: -8 S eight times (one ld1 fills both accumulators of the row),
// S the row's sum over the group; then one group of slack (the asm loads the next group's values
// after the last). In the call's scratch (scratch_bytes); mxfp4 and 8-bit codes need none (they
// start from zero).
size_t scratch_bytes(int64_t m, int64_t n, int64_t k, const W4Layout& w) {
  if (w.format != W4Format::int4 || m <= 0 || n <= 0) return 0;
  return size_t(m * (k / w.group) + 1) * 8 * sizeof(int32_t);
}

const int32_t* init_sums(int64_t m, int64_t k, int64_t g, const int8_t* a, void* scratch) {
  const int64_t groups = k / g;
  int32_t* const buf = static_cast<int32_t*>(scratch);
  int32_t* d = buf;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t gi = 0; gi < groups; ++gi, d += 8) {
      const int8_t* r = a + i * k + gi * g;
      int32x4_t acc = vdupq_n_s32(0);
      for (int64_t x = 0; x < g; x += 16) acc = vpadalq_s16(acc, vpaddlq_s8(vld1q_s8(r + x)));
      const int32x4_t v = vdupq_n_s32(-8 * vaddvq_s32(acc));
      vst1q_s32(d, v);
      vst1q_s32(d + 4, v);
    }
  return buf;
}

// --- The tile asm ------------------------------------------------------------------------------
// Scratch: A rows in v0-v3, the 4 code registers in v4-v7, the two unpacked operands in v8
// (columns 0-3) and v9 (columns 4-7), mxfp4's scale constants in v10 (2^-127) and v11 (0.5), the
// group's scales in v12, v13; mask and table are operands (v14, v15); 8-bit codes: the 8 operand
// registers of 16 k in v4-v11 (two ld1), no unpacking. Row i: int32 accumulators
// v(16 + 2i), v(17 + 2i); fp32 ones v(24 + 2i), v(25 + 2i); at a group end (kGs) its group scale
// in lane 0 of v(4 + i) (free there).
#define Q4D_UNP_I4(r) "and v8.16b, " r ".16b, %[mask].16b\n\t"
#define Q4D_UNP_I4_HI(r) r
#define Q4D_UNP_MX(r)                                                              \
  "and v8.16b, " r ".16b, %[mask].16b\n\tushr v9.16b, " r ".16b, #4\n\t"           \
  "tbl v8.16b, {%[tab].16b}, v8.16b\n\ttbl v9.16b, {%[tab].16b}, v9.16b\n\t"
#define Q4D_UNP_MX_HI(r) "v9"
#define Q4D_DOT(U, r, lo, hi, a, q)                                   \
  "sdot " lo ".4s, v8.16b, " a ".4b[" #q "]\n\tsdot " hi ".4s, " U##_HI(r) \
  ".16b, " a ".4b[" #q "]\n\t"
#define Q4D_Q1(U, r, q) U(r) Q4D_DOT(U, r, "v16", "v17", "v0", q)
#define Q4D_Q2(U, r, q) Q4D_Q1(U, r, q) Q4D_DOT(U, r, "v18", "v19", "v1", q)
#define Q4D_Q3(U, r, q) Q4D_Q2(U, r, q) Q4D_DOT(U, r, "v20", "v21", "v2", q)
#define Q4D_Q4(U, r, q) Q4D_Q3(U, r, q) Q4D_DOT(U, r, "v22", "v23", "v3", q)
#define Q4D_LDA1 "ldr q0, [%[a0]], #16\n\t"
#define Q4D_LDA2 Q4D_LDA1 "ldr q1, [%[a1]], #16\n\t"
#define Q4D_LDA3 Q4D_LDA2 "ldr q2, [%[a2]], #16\n\t"
#define Q4D_LDA4 Q4D_LDA3 "ldr q3, [%[a3]], #16\n\t"
// 16 k of R rows.
#define Q4D_CHUNK(R, U)                                                                  \
  Q4D_LDA##R "ld1 {v4.16b-v7.16b}, [%[b]], #64\n\t" Q4D_Q##R(U, "v4", 0)                 \
      Q4D_Q##R(U, "v5", 1) Q4D_Q##R(U, "v6", 2) Q4D_Q##R(U, "v7", 3)
// 8-bit codes: the 4-k group q's two operand registers (columns 0-3, 4-7) are lo, hi as loaded.
#define Q4D8_DOT(lo, hi, a, q, rl, rh) \
  "sdot " lo ".4s, " rl ".16b, " a ".4b[" #q "]\n\tsdot " hi ".4s, " rh ".16b, " a ".4b[" #q "]\n\t"
#define Q4D8_Q1(rl, rh, q) Q4D8_DOT("v16", "v17", "v0", q, rl, rh)
#define Q4D8_Q2(rl, rh, q) Q4D8_Q1(rl, rh, q) Q4D8_DOT("v18", "v19", "v1", q, rl, rh)
#define Q4D8_Q3(rl, rh, q) Q4D8_Q2(rl, rh, q) Q4D8_DOT("v20", "v21", "v2", q, rl, rh)
#define Q4D8_Q4(rl, rh, q) Q4D8_Q3(rl, rh, q) Q4D8_DOT("v22", "v23", "v3", q, rl, rh)
#define Q4D8_CHUNK(R)                                                                     \
  Q4D_LDA##R "ld1 {v4.16b-v7.16b}, [%[b]], #64\n\tld1 {v8.16b-v11.16b}, [%[b]], #64\n\t" \
      Q4D8_Q##R("v4", "v5", 0) Q4D8_Q##R("v6", "v7", 1) Q4D8_Q##R("v8", "v9", 2)           \
          Q4D8_Q##R("v10", "v11", 3)
// The 16-k step of each format.
#define Q4D_BODY_I4(R) Q4D_CHUNK(R, Q4D_UNP_I4)
#define Q4D_BODY_MX(R) Q4D_CHUNK(R, Q4D_UNP_MX)
#define Q4D_BODY_B8(R) Q4D8_CHUNK(R)
// Group end: the scales into v12, v13 (b then points at the next group's codes).
#define Q4D_SC_I4 "ldp q12, q13, [%[b]], #32\n\t"
#define Q4D_SC_MX                                                                        \
  "ldr d12, [%[b]], #8\n\tushll v12.8h, v12.8b, #7\n\tshll2 v13.4s, v12.8h, #16\n\t"     \
  "shll v12.4s, v12.4h, #16\n\tumax v12.4s, v12.4s, v10.4s\n\tumax v13.4s, v13.4s, v10.4s\n\t" \
  "fmul v0.4s, v12.4s, v11.4s\n\tfmul v1.4s, v13.4s, v11.4s\n\t"                         \
  "fsub v12.4s, v12.4s, v0.4s\n\tfsub v13.4s, v13.4s, v1.4s\n\t"
#define Q4D_SUB_I4(x, y) "sub " x ".4s, " x ".4s, " y ".4s\n\t"
#define Q4D_SUB_MX(x, y) ""
#define Q4D_SUB_B8(x, y) ""
#define Q4D_CVL(r) "scvtf " r ".4s, " r ".4s\n\t"
#define Q4D_CVH_I4(r) "scvtf " r ".4s, " r ".4s, #4\n\t"
#define Q4D_CVH_MX(r) Q4D_CVL(r)
#define Q4D_CVH_B8(r) Q4D_CVL(r)
#define Q4D_SC_B8 Q4D_SC_I4
// The row's group scale (lane 0 of ga) times the scaled products: G = 1 (kGs), or nothing.
#define Q4D_GS0(lo, hi, ga) ""
#define Q4D_GS1(lo, hi, ga) \
  "fmul " lo ".4s, " lo ".4s, " ga ".s[0]\n\tfmul " hi ".4s, " hi ".4s, " ga ".s[0]\n\t"
#define Q4D_ROW_END(F, G, lo, hi, flo, fhi, ga)                                          \
  Q4D_SUB_##F(hi, lo) Q4D_CVL(lo) Q4D_CVH_##F(hi)                                        \
  "fmul " lo ".4s, " lo ".4s, v12.4s\n\tfmul " hi ".4s, " hi ".4s, v13.4s\n\t"             \
  Q4D_GS##G(lo, hi, ga)                                                                  \
  "fadd " flo ".4s, " flo ".4s, " lo ".4s\n\tfadd " fhi ".4s, " fhi ".4s, " hi ".4s\n\t"
#define Q4D_END1(F, G) Q4D_ROW_END(F, G, "v16", "v17", "v24", "v25", "v4")
#define Q4D_END2(F, G) Q4D_END1(F, G) Q4D_ROW_END(F, G, "v18", "v19", "v26", "v27", "v5")
#define Q4D_END3(F, G) Q4D_END2(F, G) Q4D_ROW_END(F, G, "v20", "v21", "v28", "v29", "v6")
#define Q4D_END4(F, G) Q4D_END3(F, G) Q4D_ROW_END(F, G, "v22", "v23", "v30", "v31", "v7")
// kGs: the group scales of rows 0..R-1 into v4.. from one pointer gp (row 0, gst bytes per row,
// rows 2, 3 by way of n, free there), then gp to the next group. One pointer, o an input and the
// last store through n keep the asm within GCC's 30 operands.
#define Q4D_G1 "ldr s4, [%[gp]], #4\n\t"
#define Q4D_G2 "ldr s5, [%[gp], %[gst]]\n\t" Q4D_G1
#define Q4D_G3 "add %[n], %[gp], %[gst], lsl #1\n\tldr s6, [%[n]]\n\t" Q4D_G2
#define Q4D_G4 "add %[n], %[gp], %[gst], lsl #1\n\tldr s6, [%[n]]\n\tldr s7, [%[n], %[gst]]\n\t" Q4D_G2
#define Q4D_GLD0(R) ""
#define Q4D_GLD1(R) Q4D_G##R
#define Q4D_ST0 "st1 {v24.4s-v27.4s}, [%[o]], #64\n\tst1 {v28.4s-v31.4s}, [%[o]]\n\t"
#define Q4D_ST1 \
  "st1 {v24.4s-v27.4s}, [%[o]]\n\tadd %[n], %[o], #64\n\tst1 {v28.4s-v31.4s}, [%[n]]\n\t"
#define Q4D_OOUT0 , [o] "+r"(o)
#define Q4D_OOUT1 , [gp] "+r"(gp)
#define Q4D_OIN0
#define Q4D_OIN1 , [o] "r"(o), [gst] "r"(gst)
#define Q4D_INIT_I4 ""
#define Q4D_INIT_B8 ""
#define Q4D_INIT_MX "movi v10.4s, #0x40, lsl #16\n\tfmov v11.4s, #0.5\n\t"
// The next group's start values of rows 0..R-1 (pointers c0.., stepping cs bytes).
#define Q4D_C1 "ld1 {v16.4s-v17.4s}, [%[c0]], %[cs]\n\t"
#define Q4D_C2 Q4D_C1 "ld1 {v18.4s-v19.4s}, [%[c1]], %[cs]\n\t"
#define Q4D_C3 Q4D_C2 "ld1 {v20.4s-v21.4s}, [%[c2]], %[cs]\n\t"
#define Q4D_C4 Q4D_C3 "ld1 {v22.4s-v23.4s}, [%[c3]], %[cs]\n\t"
#define Q4D_ASM(R, F, G)                                                                  \
  __asm__ volatile(                                                                       \
      Q4D_C##R "ld1 {v24.4s-v27.4s}, [%[z]]\n\tld1 {v28.4s-v31.4s}, [%[z]]\n\t" Q4D_INIT_##F \
      "2:\n\tmov %[n], %[nc2]\n\t"                                                        \
      "1:\n\t" Q4D_BODY_##F(R) Q4D_BODY_##F(R)                                             \
      "subs %[n], %[n], #1\n\tb.ne 1b\n\t"                                                 \
      Q4D_SC_##F Q4D_GLD##G(R) Q4D_END##R(F, G) Q4D_C##R                                  \
      "subs %[gn], %[gn], #1\n\tb.ne 2b\n\t"                                               \
      Q4D_ST##G                                                                           \
      : [a0] "+r"(a0), [a1] "+r"(a1), [a2] "+r"(a2), [a3] "+r"(a3), [b] "+r"(b),          \
        [gn] "+r"(gn), [n] "=&r"(n) Q4D_OOUT##G, [c0] "+r"(c0), [c1] "+r"(c1),            \
        [c2] "+r"(c2), [c3] "+r"(c3)                                                      \
      : [nc2] "r"(nc2), [cs] "r"(cs), [mask] "w"(mask), [tab] "w"(tab),                   \
        [z] "r"(kZeros) Q4D_OIN##G                                                        \
      : "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11", "v12",  \
        "v13", "v16", "v17", "v18", "v19", "v20", "v21", "v22", "v23", "v24", "v25", "v26", \
        "v27", "v28", "v29", "v30", "v31", "cc", "memory")
#define Q4D_FMT(R, G)                                          \
  if constexpr (F == W4Format::int4) Q4D_ASM(R, I4, G);        \
  else if constexpr (F == W4Format::mxfp4) Q4D_ASM(R, MX, G);  \
  else Q4D_ASM(R, B8, G);
#define Q4D_GFMT(R)                  \
  if constexpr (kGs) { Q4D_FMT(R, 1) } \
  else { Q4D_FMT(R, 0) }

// The fp32 sums of R rows (A row 0 at a, rows k apart; c: row 0's start values, init_sums or
// kZeros for mxfp4) x one block (b) over all groups g: row i's 8 columns at o + 8 i. kGs: gs is
// row 0's group scales (rows k / g apart).
template <int R, W4Format F, bool kGs>
void tile_sums(const int8_t* a, const int32_t* c, int64_t k, int64_t g, const uint8_t* b,
               const int8_t* table, float* o, const float* gs) {
  // Rows past R are never read: their pointers stay at row 0 (inside the buffer).
  const int8_t *a0 = a, *a1 = R > 1 ? a + k : a, *a2 = R > 2 ? a + 2 * k : a;
  const int8_t* a3 = R > 3 ? a + 3 * k : a;
  uint64_t gn = uint64_t(k / g), n;
  constexpr bool kInt4 = F == W4Format::int4;
  const int64_t cs = kInt4 ? 32 : 0, crow = kInt4 ? (k / g) * 8 : 0;
  const int32_t *c0 = c, *c1 = R > 1 ? c + crow : c, *c2 = R > 2 ? c + 2 * crow : c;
  const int32_t* c3 = R > 3 ? c + 3 * crow : c;
  const uint64_t nc2 = uint64_t(g) / 32;  // two 16-k chunks per iteration
  const uint8x16_t mask = vdupq_n_u8(0x0f);
  const int8x16_t tab = vld1q_s8(table);
  const float* gp = gs;  // kGs: row i's group scales at gp + i * gst bytes (only rows < R read)
  const int64_t gst = (k / g) * int64_t(sizeof(float));
  if constexpr (R == 1) { Q4D_GFMT(1) }
  else if constexpr (R == 2) { Q4D_GFMT(2) }
  else if constexpr (R == 3) { Q4D_GFMT(3) }
  else { Q4D_GFMT(4) }
  (void)n;
  (void)gp, (void)gst;
}

template <int R, W4Format F, bool kGs>
void tile(const int8_t* a, const int32_t* c, int64_t k, const W4Layout& w, const uint8_t* b,
          float* d, int64_t stride, int64_t nc, const float* ls, const float* bias,
          const float* gs) {
  alignas(16) float sums[32];
  // 8-bit codes have no table (the asm's tab operand is then unused zeros).
  const int8_t* table = F == W4Format::int8_affine ? reinterpret_cast<const int8_t*>(kZeros)
                                                   : w4_decode_table(w.format);
  tile_sums<R, F, kGs>(a, c, k, w.group, b, table, sums, gs);
  for (int i = 0; i < R; ++i)
    store_q4_row8(d + i * stride, vld1q_f32(sums + 8 * i), vld1q_f32(sums + 8 * i + 4), nc, ls[i],
                  bias);
}

// kGs: with ep.lhs_group_scale.
template <W4Format F, bool kGs>
void run(int64_t m, int64_t n, int64_t k, const W4Layout& w, const void* lhs, const void* rhs,
         float* dst, int64_t stride, const Q4GemmEpilogue& ep) {
  const auto* a = static_cast<const int8_t*>(lhs);
  const auto* b = static_cast<const uint8_t*>(rhs);
  constexpr bool kInt4 = F == W4Format::int4;
  const int32_t* init = kInt4 ? init_sums(m, k, w.group, a, ep.scratch) : kZeros;
  for (int64_t j0 = 0; j0 < n; j0 += kNr) {
    const int64_t nc = std::min(kNr, n - j0);
    const uint8_t* blk = b + Packing::rhs_offset(j0, k, w);
    const float* bias = ep.bias != nullptr ? ep.bias + j0 : nullptr;
    for (int64_t i0 = 0; i0 < m; i0 += kMr) {
      const int8_t* ai = a + i0 * k;
      const int32_t* ci = kInt4 ? init + i0 * (k / w.group) * 8 : init;
      float* d = dst + i0 * stride + j0;
      const float* ls = ep.lhs_scale + i0;
      const float* gs = kGs ? ep.lhs_group_scale + i0 * (k / w.group) : nullptr;
      switch (std::min(kMr, m - i0)) {
        case 4: tile<4, F, kGs>(ai, ci, k, w, blk, d, stride, nc, ls, bias, gs); break;
        case 3: tile<3, F, kGs>(ai, ci, k, w, blk, d, stride, nc, ls, bias, gs); break;
        case 2: tile<2, F, kGs>(ai, ci, k, w, blk, d, stride, nc, ls, bias, gs); break;
        default: tile<1, F, kGs>(ai, ci, k, w, blk, d, stride, nc, ls, bias, gs); break;
      }
    }
  }
}

}  // namespace

extern const Q4GemmUkernel q4gemm_qs8r_q4ci8x4_4x8_neon_dotprod = make_q4gemm<LhsPacking, Packing>(
    "q4gemm_qs8r_q4ci8x4_4x8_neon_dotprod", Isa::neon_dotprod, kMr, pack_lhs_qs8r<LhsPacking>,
    pack_rhs_q4<Packing, Interleaved4, OffsetLowInt4>,
    q4_run_f32<run<W4Format::int4, false>, run<W4Format::mxfp4, false>,
               run<W4Format::int8_affine, false>, run<W4Format::int4, true>,
               run<W4Format::mxfp4, true>, run<W4Format::int8_affine, true>>,
    scratch_bytes);

}  // namespace cpumoe
