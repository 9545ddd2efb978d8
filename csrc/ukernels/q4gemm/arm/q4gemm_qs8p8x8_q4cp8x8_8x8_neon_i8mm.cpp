// q4gemm_qs8p8x8_q4cp8x8_8x8_neon_i8mm: the W4A8 GEMM on SMMLA (Armv8.6 FEAT_I8MM).
//
// A is the int8 I8MM kernel's `qs8p8x8` (its packer, qs8p8x8_pack.h): blocks of 8 rows, row pairs
// interleaved in 8-k slices (slice s of a block: 64 bytes at s * 64, pair p at 16 p).
// B (`q4cp8x8`): blocks of 8 columns (Q4Packing<8>: per group the codes, 4 g bytes, then the 8
// scales). The codes of a group are the SMMLA operands of `qs8cp8x8` two slices to a byte: for
// slices 2t and 2t + 1, 64 bytes at t * 64 hold the four column-pair registers (pair c at 16 c:
// column 2c's 8 k, then column 2c + 1's), the code of slice 2t in the low nibble and of slice
// 2t + 1 in the high nibble of the same byte. So one 16-byte load gives both slices' operands of
// a column pair with one instruction each (q4gemm_arm_common.h: int4 `shl #4` / `and #0xf0`,
// values times 16; mxfp4 `and` / `ushr` + `tbl`), and no shuffle is ever needed.
//
// Register tiles: NP row pairs x NB column blocks, int32 accumulators (4 per pair and block, as
// in the int8 kernel: [r c, r c+1, r+1 c, r+1 c+1]) for one group, zeroed at its start; at the
// group end each goes through scvtf (the fixed-point #4 form for int4 removes the 16), one fmul
// by the group scales of its column pair ([s_c s_c+1 s_c s_c+1]: one `dup .d` of the 4 scales) and
// one fadd into the fp32 accumulators: the oracle's acc + float(isum) * s, in g order, no FMA.
// One-row tiles (decode) first zip the useful halves of two accumulators (row 0 of 4 columns),
// halving the group-end work and the fp32 accumulators. Tiles: 1 row: 1x3 (12 int32 + 6 fp32
// accumulators); 2 rows: 1x2; 3-8 rows: 2x1, 3x1, 4x1 (one whole A block per column block: the
// unpacking of each B register serves 4 row pairs).
//
// Walk: a call of one row tile (m <= 8: decode and most experts) passes over its columns once,
// so each weight byte is read exactly once per call (decode streams B: 64 bytes per 8 SMMLA per
// row pair); more rows walk steps of 6 column blocks outer and row tiles inner, so a step's packed
// B (6 x (4 k + scales) bytes) stays in L1/L2 while the row tiles pass. The sums do not depend on
// the tiling. A partial last block (n % 8) is computed whole (its padding codes are 0) and stored
// to its first n % 8 columns only.
// @pre m, n >= 0, k % group == 0, group % 32 == 0; packed buffers from this kernel's packers.
// Features used: NEON, I8MM (SMMLA).
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_MATMUL_INT8)
#error "q4gemm_qs8p8x8_q4cp8x8_8x8_neon_i8mm.cpp needs -march=armv8.2-a+i8mm (set per file by CMake)"
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
using Packing = Q4Packing<kNr>;

// Nibble position of column c's code kk of a group (see the file comment).
struct PairSlices {
  static int64_t index(int64_t c, int64_t kk, int64_t /*g*/) {
    const int64_t s = kk / 8;
    const int64_t byte = (s / 2) * 64 + (c / 2) * 16 + (c % 2) * 8 + kk % 8;
    return 2 * byte + (s % 2);
  }
};

void pack_lhs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  pack_lhs_qs8p8x8(m, k, LhsPacking::padded_k(k), rows, static_cast<int8_t*>(packed));
}

// What a tile needs of the call.
struct Call {
  int64_t g, groups;
  int64_t group_bytes, codes_bytes;
  size_t block_bytes;
  const int8_t* table;
};

// One tile: NP row pairs (rows valid rows, NP = (rows + 1) / 2; kOneRow: rows == 1) x NB full or
// padded blocks over all groups. a: row pair 0's slice 0 (an A block start); b: block 0; out: row
// 0, column 0 of the tile; nc: columns of the tile's last block inside n (1..8).
template <int NP, int NB, W4Format F, bool kOneRow>
void tile(const Call& cl, const int8_t* a, const uint8_t* b, float* out, int64_t stride,
          int64_t rows, int64_t nc, const float* ls, const float* bias) {
  static_assert(!kOneRow || NP == 1, "one-row tiles have one row pair");
  constexpr int kF = kOneRow ? 2 : 4;  // fp32 accumulators per pair and block
  const W4Codes<F> codes(cl.table);
  float32x4_t facc[NP][NB][kF];
  for (int p = 0; p < NP; ++p)
    for (int j = 0; j < NB; ++j)
      for (int c = 0; c < kF; ++c) facc[p][j][c] = vdupq_n_f32(0.0f);
  const int64_t pairs = cl.g / 16;  // slice pairs per group
  for (int64_t gi = 0; gi < cl.groups; ++gi) {
    int32x4_t acc[NP][NB][4];
    for (int p = 0; p < NP; ++p)
      for (int j = 0; j < NB; ++j)
        for (int c = 0; c < 4; ++c) acc[p][j][c] = vdupq_n_s32(0);
    const int8_t* ag = a + gi * cl.g * 8;
    const uint8_t* bg = b + gi * cl.group_bytes;
    for (int64_t t = 0; t < pairs; ++t) {
      int8x16_t a0[NP], a1[NP];
      for (int p = 0; p < NP; ++p) {
        a0[p] = vld1q_s8(ag + t * 128 + 16 * p);
        a1[p] = vld1q_s8(ag + t * 128 + 64 + 16 * p);
      }
      for (int j = 0; j < NB; ++j) {
        const uint8x16x4_t r = vld1q_u8_x4(bg + j * cl.block_bytes + t * 64);
        const uint8x16_t rr[4] = {r.val[0], r.val[1], r.val[2], r.val[3]};
        for (int c = 0; c < 4; ++c) {
          const int8x16_t lo = codes.lo(rr[c]), hi = codes.hi(rr[c]);
          for (int p = 0; p < NP; ++p) acc[p][j][c] = vmmlaq_s32(acc[p][j][c], a0[p], lo);
          for (int p = 0; p < NP; ++p) acc[p][j][c] = vmmlaq_s32(acc[p][j][c], a1[p], hi);
        }
      }
    }
    // Group end: acc += float(isum) * scale, per column.
    for (int j = 0; j < NB; ++j) {
      float32x4_t s0, s1;
      group_scales8<F>(bg + j * cl.block_bytes + cl.codes_bytes, s0, s1);
      if constexpr (kOneRow) {
        const int32x4_t i0 = vreinterpretq_s32_s64(
            vzip1q_s64(vreinterpretq_s64_s32(acc[0][j][0]), vreinterpretq_s64_s32(acc[0][j][1])));
        const int32x4_t i1 = vreinterpretq_s32_s64(
            vzip1q_s64(vreinterpretq_s64_s32(acc[0][j][2]), vreinterpretq_s64_s32(acc[0][j][3])));
        facc[0][j][0] = vaddq_f32(facc[0][j][0], vmulq_f32(W4Codes<F>::cvt(i0), s0));
        facc[0][j][1] = vaddq_f32(facc[0][j][1], vmulq_f32(W4Codes<F>::cvt(i1), s1));
      } else {
        const float64x2_t d0 = vreinterpretq_f64_f32(s0), d1 = vreinterpretq_f64_f32(s1);
        const float32x4_t sc[4] = {vreinterpretq_f32_f64(vdupq_laneq_f64(d0, 0)),
                                   vreinterpretq_f32_f64(vdupq_laneq_f64(d0, 1)),
                                   vreinterpretq_f32_f64(vdupq_laneq_f64(d1, 0)),
                                   vreinterpretq_f32_f64(vdupq_laneq_f64(d1, 1))};
        for (int p = 0; p < NP; ++p)
          for (int c = 0; c < 4; ++c)
            facc[p][j][c] =
                vaddq_f32(facc[p][j][c], vmulq_f32(W4Codes<F>::cvt(acc[p][j][c]), sc[c]));
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t jc = j == NB - 1 ? nc : kNr;
    const float* bj = bias != nullptr ? bias + j * kNr : nullptr;
    float* oj = out + j * kNr;
    if constexpr (kOneRow) {
      store_q4_row8(oj, facc[0][j][0], facc[0][j][1], jc, ls[0], bj);
    } else {
      for (int p = 0; p < NP; ++p) {
        const auto lo = [&](int c) { return vreinterpretq_f64_f32(facc[p][j][c]); };
        // Row 2p: the low halves of the column pairs; row 2p + 1: the high halves.
        store_q4_row8(oj + 2 * p * stride, vreinterpretq_f32_f64(vzip1q_f64(lo(0), lo(1))),
                      vreinterpretq_f32_f64(vzip1q_f64(lo(2), lo(3))), jc, ls[2 * p], bj);
        if (2 * p + 1 < rows)
          store_q4_row8(oj + (2 * p + 1) * stride,
                        vreinterpretq_f32_f64(vzip2q_f64(lo(0), lo(1))),
                        vreinterpretq_f32_f64(vzip2q_f64(lo(2), lo(3))), jc, ls[2 * p + 1], bj);
      }
    }
  }
}

// Blocks [jb, jb + nb) of the row tile at A block `a` (rows valid rows): tiles of NB blocks,
// then the rest with NB - 1, ... 1.
template <int NP, int NB, W4Format F, bool kOneRow>
void blocks(const Call& cl, const int8_t* a, const uint8_t* b, int64_t jb, int64_t nb, int64_t n,
            float* d, int64_t stride, int64_t rows, const float* ls, const float* bias) {
  for (; nb >= NB; nb -= NB, jb += NB) {
    const int64_t j0 = jb * kNr;
    const int64_t nc = std::min<int64_t>(kNr, n - (j0 + (NB - 1) * kNr));
    tile<NP, NB, F, kOneRow>(cl, a, b + size_t(jb) * cl.block_bytes, d + j0, stride, rows, nc,
                             ls, bias != nullptr ? bias + j0 : nullptr);
  }
  if constexpr (NB > 1) {
    if (nb > 0) blocks<NP, NB - 1, F, kOneRow>(cl, a, b, jb, nb, n, d, stride, rows, ls, bias);
  }
}

template <W4Format F>
void row_tile(const Call& cl, const int8_t* a, const uint8_t* b, int64_t jb, int64_t nb,
              int64_t n, float* d, int64_t stride, int64_t rows, const float* ls,
              const float* bias) {
  switch ((rows + 1) / 2) {
    case 4: blocks<4, 1, F, false>(cl, a, b, jb, nb, n, d, stride, rows, ls, bias); break;
    case 3: blocks<3, 1, F, false>(cl, a, b, jb, nb, n, d, stride, rows, ls, bias); break;
    case 2: blocks<2, 1, F, false>(cl, a, b, jb, nb, n, d, stride, rows, ls, bias); break;
    default:
      if (rows == 1) blocks<1, 3, F, true>(cl, a, b, jb, nb, n, d, stride, rows, ls, bias);
      else blocks<1, 2, F, false>(cl, a, b, jb, nb, n, d, stride, rows, ls, bias);
      break;
  }
}

template <W4Format F>
void run(int64_t m, int64_t n, int64_t k, const W4Layout& w, const int8_t* a, const uint8_t* b,
         float* dst, int64_t stride, const Q4GemmEpilogue& ep) {
  const Call cl{w.group,         k / w.group,
                Packing::group_bytes(w), Packing::codes_bytes(w),
                Packing::block_bytes(k, w), w4_decode_table(w.format)};
  const int64_t nblocks = (n + kNr - 1) / kNr;
  const int64_t step = m <= kMr ? nblocks : kStepBlocks;
  for (int64_t jb = 0; jb < nblocks; jb += step) {
    const int64_t nb = std::min(step, nblocks - jb);
    for (int64_t i0 = 0; i0 < m; i0 += kMr)
      row_tile<F>(cl, a + i0 * k, b, jb, nb, n, dst + i0 * stride, stride,
                  std::min(kMr, m - i0), ep.lhs_scale + i0, ep.bias);
  }
}

void run_f32(int64_t m, int64_t n, int64_t k, const W4Layout& w, const void* lhs, const void* rhs,
             float* dst, int64_t dst_stride, const Q4GemmEpilogue& ep) {
  if (m <= 0 || n <= 0) return;
  const auto* a = static_cast<const int8_t*>(lhs);
  const auto* b = static_cast<const uint8_t*>(rhs);
  if (w.format == W4Format::mxfp4) run<W4Format::mxfp4>(m, n, k, w, a, b, dst, dst_stride, ep);
  else run<W4Format::int4>(m, n, k, w, a, b, dst, dst_stride, ep);
}

}  // namespace

extern const Q4GemmUkernel q4gemm_qs8p8x8_q4cp8x8_8x8_neon_i8mm =
    make_q4gemm<LhsPacking, Packing>("q4gemm_qs8p8x8_q4cp8x8_8x8_neon_i8mm", Isa::neon_i8mm, kMr,
                                     pack_lhs, pack_rhs_q4<Packing, PairSlices>, run_f32);

}  // namespace cpumoe
