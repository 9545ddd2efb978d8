// f8gemm_bf16p2x4_f8cp8x4_8x8_neon_bf16: the W8A16 FP8 GEMM on BFMMLA (FEAT_BF16), the codes
// turned into bf16 in registers.
//
// BFMMLA multiplies a 2x4 bf16 block of A by a 4x2 block of B^T into a 2x2 fp32 block. A is
// `bf16p2x4`, the bf16 GEMM's BFMMLA operand (neon_bf16_common.h: row pairs interleaved in 4-k
// slices, 16 bytes per slice; its packer). B (`f8cp8x4`): F8Packing blocks of 8 columns, per
// group in 4-k slices of 32 bytes, column pair cp's 8 codes at 8 cp (column 2 cp's 4 k, then
// 2 cp + 1's): a slice is the codes of the four BFMMLA operands of `bf16cp8x4`, one byte each.
// Codes and scales as given (KeepF8).
//
// Decode, exact, per 8 codes (one operand): sshll #7 of the signed bytes and bic of bit 14 give
// the fp16 of e4m3(c) * 2^-8 (f8gemm_f32r_f8ck8_8x8_neon.cpp says why), fcvtl / fcvtl2 widen it
// to fp32 exactly (E4M3 subnormals become normal fp32), and uzp2 keeps the high halves: the bf16
// of the same value, exact (4 significant bits; the low halves are zero). 5 instructions per 8
// codes; every operand is normal bf16 (at least 2^-17), so BFMMLA's flushing never touches the
// weights. The factor 2^8 goes to the group sums at the group's end: sum * 256 (exact), * the
// scales (the one rounding of S_g * s_g), + the output's total, in increasing g (the interface's
// arithmetic; no FMA there).
//
// Numerics of a group sum: BFMMLA (FEAT_BF16 without FEAT_EBF16, FPCR.EBF = 0) adds to each
// output (a0 b0 + a1 b1), then (a2 b2 + a3 b3), each addition rounded to odd in fp32, subnormal
// inputs and results flushed to zero (bgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16.cpp). The products
// are exact; a product of a group of L k passes through at most L / 2 + 1 roundings of at most
// 2^-23 relative each: (L + 2) 2^-24 sum |a b| at most, within f8gemm_tester.h's bound
// (L + 2 G + 4) 2^-24 (sum |a b| s) with the epilogue's two roundings per group. Subnormal bf16
// activations count as zero (f8gemm.h allows it). An output's sum is the same BFMMLA chain over
// its k in order whatever the tile, so the bits do not depend on the call's m, n or offsets.
//
// Tiles (row pairs x column blocks; group sums in registers, totals in memory touched once per
// group). m <= 8, one row tile, the codes decoded in registers: m <= 2: 1 pair x 4 blocks (16
// BFMMLA chains; decode: each operand used once); m <= 4: 2 x 2; otherwise up to 4 pairs x 1
// block (8 x 8: each operand feeds 4 BFMMLA). m > 8, several row tiles: per block, group and
// piece of at most 512 k, the operands are decoded once into the call's scratch (scratch_bytes:
// 8 KB and 512 bytes per 8 rows), then every 4-pair row tile runs over them, its sums (between
// pieces) and totals waiting in the scratch: per 4 k and 8 columns, 27 instructions per 8-row
// tile (16 BFMMLA, 4 A loads, 2 ldp of operands) plus 29 for the decode, once. Same BFMMLA
// chain and group ends either way, so the same bits.
//
// 4-bit codes (W4A16, F8Layout::code_bits 4): Codes<4> decodes a slice from 16 bytes through two
// table lookups (11 instructions per 32 weights); the same operands, so the same bits.
//
// @pre m, n >= 0, k >= 1; packed buffers from this kernel's packers.
// Features used: NEON, BF16 (BFMMLA).
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#error "f8gemm_bf16p2x4_f8cp8x4_8x8_neon_bf16.cpp needs -march=armv8.2-a+bf16 (set per file by CMake)"
#endif

#include <arm_neon.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ukernels/common/arm/neon_bf16_common.h"
#include "ukernels/common/arm/neon_common.h"  // store_row_f32x8
#include "ukernels/f8gemm/f8gemm_common.h"

namespace cpumoe {
namespace {

// A as bf16p2x4 (2 bytes, row pairs), B in blocks of 8 columns, 4-k slices.
using Packing = F8Packing</*Nr=*/8, /*Kr=*/kBf16pKr, /*LhsBytes=*/2, /*LhsRows=*/2,
                          /*NibbleSpan=*/16>;
constexpr int64_t kMr = 8;
constexpr int64_t kNr = Packing::kNr;

// `f8cp8x4`: per 4-k slice (32 bytes) column pair cp's codes at 8 cp, column 2 cp's 4 k first.
struct PairSlices {
  static int64_t index(int64_t c, int64_t kk, int64_t /*gp*/) {
    return (kk / 4) * 32 + (c / 2) * 8 + (c % 2) * 4 + kk % 4;
  }
};

// bf16 sources: the A packer only moves them.
struct FromBf16 {
  static uint16x8_t eight(const uint16_t* p) { return vld1q_u16(p); }
  static uint16_t one(uint16_t v) { return v; }
};

using Call = F8Call;  // what every tile of one call shares

// 8 codes (one column pair's 4-k operand) -> the bf16 of their values times 2^-8.
__attribute__((always_inline)) inline bfloat16x8_t decode8(int8x8_t c) {
  const int16x8_t h = vbicq_s16(vshll_n_s8(c, 7), vdupq_n_s16(0x4000));
  const float32x4_t lo = vcvt_f32_f16(vreinterpret_f16_s16(vget_low_s16(h)));
  const float32x4_t hi = vcvt_high_f32_f16(vreinterpretq_f16_s16(h));
  return vreinterpretq_bf16_u16(vuzp2q_u16(vreinterpretq_u16_f32(lo), vreinterpretq_u16_f32(hi)));
}

// A call's codes (F8Layout::code_bits): Bits 8, E4M3 (decode8); Bits 4, codebook indices, a
// slice's 32 in 16 bytes (nibble span 16: byte j holds positions j and 16 + j), looked up with
// tbl in the low and high bytes of the codebook's bf16 values times 2^-8 (normal bf16: small
// integers or E2M1 values) and zipped: 11 instructions per slice where E4M3 codes take 22.
template <int Bits>
struct Codes {
  static_assert(Bits == 8 || Bits == 4, "E4M3 codes or 4-bit indices");
  static constexpr int64_t kSlice = 4 * Bits;  // code bytes of one 4-k slice of a block
  uint8x16_t lo, hi;                           // Bits 4: the table's low and high bytes
  // The table of @p w's codebook (Bits 4).
  static Codes of(const F8Layout& w) {
    uint8_t t[2][16] = {};
    if (Bits == 4) {
      float v[16];
      f8_codebook_values(w, 1.0f / 256.0f, v);
      for (int i = 0; i < 16; ++i) {
        uint32_t u;
        std::memcpy(&u, &v[i], 4);
        t[0][i] = uint8_t(u >> 16);  // bf16 (exact: 4 significant bits), its low byte
        t[1][i] = uint8_t(u >> 24);
      }
    }
    return Codes{vld1q_u8(t[0]), vld1q_u8(t[1])};
  }
  // The 4 operands of one 4-k slice of a block (its codes at p).
  __attribute__((always_inline)) void slice(const uint8_t* p, bfloat16x8_t (&op)[4]) const {
    if constexpr (Bits == 8) {
      const int8x16_t c01 = vld1q_s8(reinterpret_cast<const int8_t*>(p));
      const int8x16_t c23 = vld1q_s8(reinterpret_cast<const int8_t*>(p + 16));
      op[0] = decode8(vget_low_s8(c01));
      op[1] = decode8(vget_high_s8(c01));
      op[2] = decode8(vget_low_s8(c23));
      op[3] = decode8(vget_high_s8(c23));
    } else {
      const uint8x16_t x = vld1q_u8(p);
      const uint8x16_t i01 = vandq_u8(x, vdupq_n_u8(15)), i23 = vshrq_n_u8(x, 4);
      const uint8x16_t l01 = vqtbl1q_u8(lo, i01), h01 = vqtbl1q_u8(hi, i01);
      const uint8x16_t l23 = vqtbl1q_u8(lo, i23), h23 = vqtbl1q_u8(hi, i23);
      op[0] = vreinterpretq_bf16_u8(vzip1q_u8(l01, h01));
      op[1] = vreinterpretq_bf16_u8(vzip2q_u8(l01, h01));
      op[2] = vreinterpretq_bf16_u8(vzip1q_u8(l23, h23));
      op[3] = vreinterpretq_bf16_u8(vzip2q_u8(l23, h23));
    }
  }
};

// The group sums of an NP x NB tile over `slices` (>= 1) 4-k slices: row pair p of A at
// a + p * pair_stride (bf16). B: Decoded = false: block nb's codes at b + nb * bstride, decoded
// here; Decoded = true (NB = 1): the slices' operands decoded already (decode_chunk), 64 bytes
// per slice. The sums start from zero, or from `init` (a piece of a group: the sums so far, as
// `out` has them). At the end, with out: the sums into out, per (pair p, column pair c of block
// nb) the 2x2 block [r0 c0, r0 c1, r1 c0, r1 c1] at 4 i, i = (p NB + nb) 4 + c (a piece of a
// group follows); without: the group's end, tot[4 i ..] += (sum * 256) * the scales of the
// block's columns [s_2c s_2c+1 s_2c s_2c+1] (block nb's scales at sc + nb * bstride). Either way
// each sum is the same chain of BFMMLA over its k in order. Not inlined: the loop is
// register-allocated on its own.
template <int NP, int NB, bool Decoded, int Bits = 8>
__attribute__((noinline)) void group_sums(const bfloat16_t* a, int64_t pair_stride,
                                          const uint8_t* b, int64_t bstride, int64_t slices,
                                          const float* init, float* out, float* tot,
                                          const uint8_t* sc, const Codes<Bits>& codes) {
  static_assert(!Decoded || NB == 1, "decoded operands are one block's");
  float32x4_t acc[NP][4 * NB];
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 16
    for (int c = 0; c < 4 * NB; ++c)
      acc[p][c] = init != nullptr ? vld1q_f32(init + 4 * (p * 4 * NB + c)) : vdupq_n_f32(0.0f);
  do {
    bfloat16x8_t av[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) av[p] = vld1q_bf16(a + p * pair_stride);
    a += 8;
#pragma GCC unroll 4
    for (int nb = 0; nb < NB; ++nb) {
      bfloat16x8_t op[4];
      if constexpr (Decoded) {
        const auto* d = reinterpret_cast<const bfloat16_t*>(b);
        op[0] = vld1q_bf16(d);
        op[1] = vld1q_bf16(d + 8);
        op[2] = vld1q_bf16(d + 16);
        op[3] = vld1q_bf16(d + 24);
      } else {
        codes.slice(b + nb * bstride, op);
      }
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c)
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p)
          acc[p][4 * nb + c] = vbfmmlaq_f32(acc[p][4 * nb + c], av[p], op[c]);
    }
    b += Decoded ? 64 : Codes<Bits>::kSlice;
  } while (--slices > 0);
  if (out != nullptr) {
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 16
      for (int c = 0; c < 4 * NB; ++c) vst1q_f32(out + 4 * (p * 4 * NB + c), acc[p][c]);
    return;
  }
  const float32x4_t k256 = vdupq_n_f32(256.0f);
#pragma GCC unroll 4
  for (int nb = 0; nb < NB; ++nb)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      uint64_t pair;
      std::memcpy(&pair, sc + nb * bstride + 8 * c, 8);
      const float32x4_t sv = vreinterpretq_f32_u64(vdupq_n_u64(pair));
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        float* t = tot + 4 * ((p * NB + nb) * 4 + c);
        vst1q_f32(t, vaddq_f32(vld1q_f32(t), vmulq_f32(vmulq_f32(acc[p][4 * nb + c], k256), sv)));
      }
    }
}

// The operands of `slices` 4-k slices of one block (codes at b) into d, 64 bytes per slice.
template <int Bits>
void decode_chunk(const Codes<Bits>& codes, const uint8_t* b, int64_t slices, bfloat16_t* d) {
  for (int64_t x = 0; x < slices; ++x, b += Codes<Bits>::kSlice, d += 32) {
    bfloat16x8_t op[4];
    codes.slice(b, op);
    vst1q_bf16(d, op[0]);
    vst1q_bf16(d + 8, op[1]);
    vst1q_bf16(d + 16, op[2]);
    vst1q_bf16(d + 24, op[3]);
  }
}

// The rows of NP pairs x NB blocks from their totals (as group_sums leaves them): `rows`
// (> 2 (NP - 1)) destination rows at dst (dst_stride apart), `cols` (> 8 (NB - 1)) columns.
template <int NP, int NB>
void store_tile(const float (*tot)[4], float* dst, int64_t dst_stride, int64_t rows,
                int64_t cols, const float* bias) {
  for (int p = 0; p < NP; ++p)
    for (int nb = 0; nb < NB; ++nb) {
      const float(*q)[4] = tot + (p * NB + nb) * 4;
      const int64_t nc = std::min<int64_t>(8, cols - 8 * nb);
      const float* bj = bias != nullptr ? bias + 8 * nb : nullptr;
      float* d = dst + 2 * p * dst_stride + 8 * nb;
      const float32x4_t q0 = vld1q_f32(q[0]), q1 = vld1q_f32(q[1]), q2 = vld1q_f32(q[2]),
                        q3 = vld1q_f32(q[3]);
      store_row_f32x8(d, bfmmla_row0(q0, q1), bfmmla_row0(q2, q3), nc, bj);
      if (2 * p + 1 < rows)
        store_row_f32x8(d + dst_stride, bfmmla_row1(q0, q1), bfmmla_row1(q2, q3), nc, bj);
    }
}

// An NP x NB tile over the whole depth, decoding in registers: row pairs of A at a (2 kp bf16
// apart), NB blocks of B from b; destination as store_tile.
template <int Bits, int NP, int NB>
void tile(const Call& cl, const Codes<Bits>& codes, const bfloat16_t* a, const uint8_t* b,
          float* dst, int64_t dst_stride, int64_t rows, int64_t cols, const float* bias) {
  constexpr int kAcc = NP * 4 * NB;
  float tot[kAcc][4];  // the totals, in memory: touched once per group, by group_sums
  std::memset(tot, 0, sizeof tot);
  for (int64_t g = 0; g < cl.groups; ++g) {
    const int64_t gp = Packing::group_kp(g, cl.k, *cl.w);
    const uint8_t* grp = b + g * cl.gstride;
    group_sums<NP, NB, false, Bits>(a + 2 * g * cl.gk, 2 * cl.kp, grp, cl.block_bytes,
                                    gp / kBf16pKr, nullptr, nullptr, &tot[0][0],
                                    grp + Packing::codes_bytes(gp, *cl.w), codes);
  }
  store_tile<NP, NB>(tot, dst, dst_stride, rows, cols, bias);
}

template <int Bits>
using TileFn = void (*)(const Call&, const Codes<Bits>&, const bfloat16_t*, const uint8_t*, float*,
                        int64_t, int64_t, int64_t, const float*);
// By [row pairs][blocks]: the shapes run_f32 below can ask for.
template <int Bits>
constexpr TileFn<Bits> kTiles[5][5] = {
    {},
    {nullptr, tile<Bits, 1, 1>, tile<Bits, 1, 2>, tile<Bits, 1, 3>, tile<Bits, 1, 4>},
    {nullptr, tile<Bits, 2, 1>, tile<Bits, 2, 2>},
    {nullptr, tile<Bits, 3, 1>},
    {nullptr, tile<Bits, 4, 1>},
};

// More than one row tile (m > kMr): per block, group and piece of at most kChunk k, the codes
// are decoded once into the scratch and every row tile of 4 pairs runs over them; each tile's
// group sums (a piece's end) and totals wait in the scratch. Same bits as the tiles above.
constexpr int64_t kChunk = 512;  // k per decoded piece: 8 KB of operands
constexpr int64_t kTileFloats = 16 * 4;  // a 4-pair tile's sums or totals

// The decoded piece, then the totals and the sums of each row tile.
size_t scratch_bytes(int64_t m, int64_t n, int64_t k, const F8Layout& w) {
  if (m <= kMr || n <= 0 || k <= 0) return 0;
  const int64_t piece = std::min(kChunk, Packing::padded_k(Packing::group_k(k, w)));
  return size_t(16 * piece) + size_t((m + kMr - 1) / kMr) * 2 * kTileFloats * sizeof(float);
}

using SumsFn = void (*)(const bfloat16_t*, int64_t, const uint8_t*, int64_t, int64_t,
                        const float*, float*, float*, const uint8_t*, const Codes<8>&);
using StoreFn = void (*)(const float (*)[4], float*, int64_t, int64_t, int64_t, const float*);
constexpr SumsFn kDecodedSums[5] = {nullptr, group_sums<1, 1, true>, group_sums<2, 1, true>,
                                    group_sums<3, 1, true>, group_sums<4, 1, true>};
constexpr StoreFn kStore[5] = {nullptr, store_tile<1, 1>, store_tile<2, 1>, store_tile<3, 1>,
                               store_tile<4, 1>};

template <int Bits>
void run_decoded(const Call& cl, const Codes<Bits>& codes, int64_t m, int64_t n,
                 const bfloat16_t* a, const uint8_t* b, float* dst, int64_t dst_stride,
                 const F8GemmEpilogue& ep) {
  const Codes<8> decoded{};  // unused: the operands are decoded already
  const int64_t tiles = (m + kMr - 1) / kMr, blocks = (n + kNr - 1) / kNr;
  auto* dec = static_cast<bfloat16_t*>(ep.scratch);
  const int64_t piece = std::min(kChunk, Packing::padded_k(cl.gk));
  float* const tot = reinterpret_cast<float*>(static_cast<uint8_t*>(ep.scratch) + 16 * piece);
  float* const sums = tot + tiles * kTileFloats;
  for (int64_t jb = 0; jb < blocks; ++jb) {
    const uint8_t* bj = b + jb * cl.block_bytes;
    std::memset(tot, 0, size_t(tiles * kTileFloats) * sizeof(float));
    for (int64_t g = 0; g < cl.groups; ++g) {
      const int64_t gp = Packing::group_kp(g, cl.k, *cl.w);
      const uint8_t* grp = bj + g * cl.gstride;
      for (int64_t x0 = 0; x0 < gp; x0 += kChunk) {
        const int64_t kc = std::min(kChunk, gp - x0);
        decode_chunk(codes, grp + x0 * Codes<Bits>::kSlice / kBf16pKr, kc / kBf16pKr, dec);
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t np = (std::min(kMr, m - t * kMr) + 1) / 2;
          float* st = sums + t * kTileFloats;
          kDecodedSums[np](a + t * kMr * cl.kp + 2 * (g * cl.gk + x0), 2 * cl.kp,
                           reinterpret_cast<const uint8_t*>(dec), 0, kc / kBf16pKr,
                           x0 == 0 ? nullptr : st, x0 + kc == gp ? nullptr : st,
                           tot + t * kTileFloats, grp + Packing::codes_bytes(gp, *cl.w),
                           decoded);
        }
      }
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = std::min(kMr, m - t * kMr);
      kStore[(rows + 1) / 2](reinterpret_cast<const float(*)[4]>(tot + t * kTileFloats),
                             dst + t * kMr * dst_stride + jb * kNr, dst_stride, rows,
                             std::min(kNr, n - jb * kNr),
                             ep.bias != nullptr ? ep.bias + jb * kNr : nullptr);
    }
  }
}

template <int Bits>
void run(const Call& cl, int64_t m, int64_t n, const bfloat16_t* a, const uint8_t* b, float* dst,
         int64_t dst_stride, const F8GemmEpilogue& ep) {
  const Codes<Bits> codes = Codes<Bits>::of(*cl.w);
  if (m > kMr) {
    run_decoded(cl, codes, m, n, a, b, dst, dst_stride, ep);
    return;
  }
  const int64_t blocks = (n + kNr - 1) / kNr;
  const int64_t step = m <= 2 ? 4 : m <= 4 ? 2 : 1;  // column blocks per tile
  for (int64_t jb = 0; jb < blocks; jb += step) {
    const int64_t nb = std::min(step, blocks - jb), j0 = jb * kNr;
    kTiles<Bits>[(m + 1) / 2][nb](cl, codes, a, b + jb * cl.block_bytes, dst + j0, dst_stride, m,
                                  std::min(nb * kNr, n - j0),
                                  ep.bias != nullptr ? ep.bias + j0 : nullptr);
  }
}

void run_f32(int64_t m, int64_t n, int64_t k, const F8Layout& w, const void* lhs, const void* rhs,
             float* dst, int64_t dst_stride, const F8GemmEpilogue& ep) {
  if (m <= 0 || n <= 0) return;
  const Call cl = f8_call<Packing>(k, w);
  const auto* a = static_cast<const bfloat16_t*>(lhs);
  const auto* b = static_cast<const uint8_t*>(rhs);
  if (w.code_bits == 4) run<4>(cl, m, n, a, b, dst, dst_stride, ep);
  else run<8>(cl, m, n, a, b, dst, dst_stride, ep);
}

}  // namespace

extern const F8GemmUkernel f8gemm_bf16p2x4_f8cp8x4_8x8_neon_bf16 = make_f8gemm<Packing>(
    "f8gemm_bf16p2x4_f8cp8x4_8x8_neon_bf16", Isa::neon_bf16, kMr, bf16p2x4_pack<FromBf16>,
    pack_rhs_f8<Packing, PairSlices>, run_f32, scratch_bytes);

}  // namespace cpumoe
