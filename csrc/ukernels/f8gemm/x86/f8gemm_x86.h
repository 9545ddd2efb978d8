// The logic the x86 f8gemm (W8A16 FP8: bf16 A x E4M3 codes with fp32 block scales -> fp32)
// kernels share: the E4M3 decode through fp16, the register-tile walk and the tile itself, over
// an ISA class V (AVX2: f8gemm_f32r_f8ck16_6x16_avx2.cpp, AVX-512:
// f8gemm_f32r_f8ck32_8x32_avx512_vnni.cpp) that gives the vector type and its few operations.
//
// Decode. An E4M3 code c moved into fp16 bit positions, h = (c & 0x80) << 8 | (c & 0x7F) << 7,
// is the code's value times 2^-8 exactly (fp16 has one more exponent bit, bias 15 = 7 + 8, and
// subnormals at the same place: E4M3 subnormals m / 8 * 2^-6 are the fp16 subnormals m / 8 *
// 2^-14, times 2^8), and vcvtph2ps widens fp16 to fp32 exactly. Sign-extended to 16 bits and
// shifted left by 7, a code is h with bit 14 a copy of the sign: one `and` with 0xBFFF clears
// it. So the nr codes of one k (16 bytes: AVX2, 32: AVX-512) become nr fp32 weights in one
// vpmovsxbw (with the load), vpsllw and vpand, then a vcvtph2ps per vector of fp32 and a
// vextract for the upper one: 6 instructions per 16 (AVX2) or 32 (AVX-512) weights. (No single
// integer operation maps some byte recoding to h: the sign and the magnitude move by different
// shifts.) The codes are packed as they are (KeepF8), so are the scales; the 2^8 comes back per
// group.
//
// Layouts (F8Packing<Nr, 4, 4>):
//   A (`f32r`): row i at i * kp floats, kp = round_up(k, 4), bf16 widened at packing, zero padded.
//   B (`f8ck<nr>`): blocks of nr columns; per group (F8Packing), its codes k-major (the nr codes
//      of one k contiguous: one load per k), then the group's nr fp32 scales.
// Arithmetic (f8gemm.h): per row and column, the group sum S' = sum over the group's k, in k
//   order from its first k, of a * (w 2^-8), one FMA each (a bf16 times an E4M3 value is exact in
//   fp32, so FMA or multiply-then-add give the same sum); at the group end acc = acc + (S' * 256)
//   * s (S' * 256 = the group sum S exactly, barring fp32 underflow; the scale is never scaled,
//   so any finite scale works), acc starting at 0; then + bias. The same operations for every
//   output whatever tile it falls in (rows and blocks never interact), so calls at any offsets
//   give the whole call's bits; and the portable kernel's bits too (its sums are in the same
//   order, its multiplies and adds separate).
// Walk: column steps of NB blocks (nr columns each) by row tiles of MR rows (rows split evenly over
//   the fewest tiles), each tile over the whole depth: the group sums in registers (MR x NB x 2
//   vectors), the fp32 totals in L1 (touched once per group); per k each block's codes decoded
//   once and used by every row of the tile. Few rows (decode) take more blocks per step (more
//   weight streams and independent FMA chains per decoded weight), many rows take more rows per
//   tile (more FMAs per decoded weight).
// Internal linkage on purpose (see qgemm/qgemm_common.h): each kernel file instantiates this
// with its own ISA flags.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include <immintrin.h>  // _mm_prefetch

#include "cpumoe/f8gemm.h"
#include "ukernels/f8gemm/f8gemm_common.h"

namespace cpumoe {
namespace {
namespace f8_x86 {

/// The kr of the x86 kernels: the k loop runs 4 k at a time (the last group is padded to it).
constexpr int64_t kKr = 4;
/// Software prefetch distance in each block's code stream, bytes. Zen 5 (this machine; n = k =
/// 2048, weights from memory, 1 thread): m = 1 24 -> 35 GB/s of codes with it (the plain read
/// rate), m = 8 108 -> 230 GFLOP/s; 1 and 2 KiB ahead gave less, 6 and 8 KiB the same.
constexpr int64_t kPrefetch = 4096;

/// The walk's steps: up to Rows rows per tile by Blocks blocks per column step, for calls of at
/// most SmallRows / MidRows rows (Small / Mid) and beyond (Main).
struct Steps {
  int rows, blocks;
};

/// What a tile reads besides its position.
struct Call {
  alignas(64) float tbl[16];  // 4-bit codes: the codebook's values times 2^-8 (V::decode4)
  const float* a;       // packed A, row 0 of the call
  const uint8_t* b;     // packed B, block 0 of the call
  int64_t kp;           // A's row stride (floats)
  int64_t bstride;      // B's block stride (bytes)
  int64_t n, k, gk, groups, gstride;
  float* dst;
  int64_t ld;
  const F8GemmEpilogue& ep;
  const F8Layout* w;
};

/// Rows [i0, i0 + MR) x blocks [jb, jb + NB) over the whole depth (the file comment).
/// V (the ISA class):
///   using F = the fp32 vector (kLanes lanes; a block of kNr = 2 kLanes columns is two of them);
///   F zero(); F set1(float); F bcast(const float*); F fma(F a, F b, F c) (a b + c); F mul(F, F);
///   F add(F, F);
///   F load(const float*), void store(float*, F) (aligned, L1 totals); F loadu(const uint8_t*);
///   void decode(const uint8_t* codes, F& lo, F& hi): kNr codes -> kNr weights (value 2^-8);
///   with kCodes4 (4-bit codes): void decode4(const uint8_t* codes, F tbl, F& lo, F& hi), the
///   kNr / 2 bytes of one k (nibble span kLanes: byte j holds columns j and kLanes + j) -> the
///   same, tbl = load(Call::tbl);
///   void store_row(const Call&, int64_t i, int64_t j0, int64_t nc, F v): dst (+ bias), nc <=
///   kLanes columns from j0, nothing past them written; void finish(const F8GemmEpilogue&) after
///   the call's last store (run_f32).
template <class V, int Bits, int MR, int NB>
void tile(const Call& c, int64_t i0, int64_t jb) {
  using F = typename V::F;
  constexpr int64_t kL = V::kLanes, kNr = 2 * kL, kStep = kNr * Bits / 8;
  using P = F8Packing<kNr, kKr, 4>;  // its byte offsets (codes_bytes from the layout's bits)
  const float* a = c.a + i0 * c.kp;
  const uint8_t* bp = c.b + jb * c.bstride;
  const int64_t bstride = c.bstride, kp = c.kp;
  alignas(64) float acc[MR][NB][2][kL] = {};
  const F k256 = V::set1(256.0f);
  [[maybe_unused]] F tbl;
  if constexpr (Bits == 4) tbl = V::load(c.tbl);
  for (int64_t g = 0; g < c.groups; ++g) {
    const int64_t gp = P::padded_k(std::min(c.gk, c.k - g * c.gk));
    const uint8_t* grp = bp + g * c.gstride;
    const float* ag = a + g * c.gk;
    F s[MR][NB][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) s[r][b][0] = s[r][b][1] = V::zero();
    // One k: each block's codes decoded, then used by every row (the broadcast A value is
    // loaded again per block: a load, or a memory operand of the FMA).
    const auto step = [&](int64_t x) {
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        F w0, w1;
        if constexpr (Bits == 4) V::decode4(grp + b * bstride + x * kStep, tbl, w0, w1);
        else V::decode(grp + b * bstride + x * kStep, w0, w1);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const F av = V::bcast(ag + r * kp + x);
          s[r][b][0] = V::fma(av, w0, s[r][b][0]);
          s[r][b][1] = V::fma(av, w1, s[r][b][1]);
        }
      }
    };
    static_assert(kKr == 4, "four steps per k loop");
    for (int64_t x = 0; x < gp; x += kKr) {  // gp is a multiple of kKr
      // The lines kPrefetch bytes ahead in each block's stream (the next group's codes at the
      // end of this one: a block's groups are contiguous).
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b)
        for (int64_t off = 0; off < kKr * kStep; off += 64)
          _mm_prefetch(
              reinterpret_cast<const char*>(grp + b * bstride + x * kStep + off + kPrefetch),
              _MM_HINT_T0);
      step(x);
      step(x + 1);
      step(x + 2);
      step(x + 3);
    }
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const uint8_t* sp = grp + b * bstride + P::codes_bytes(gp, *c.w);
      const F s0 = V::loadu(sp), s1 = V::loadu(sp + 4 * kL);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        V::store(acc[r][b][0], V::add(V::load(acc[r][b][0]),
                                      V::mul(V::mul(s[r][b][0], k256), s0)));
        V::store(acc[r][b][1], V::add(V::load(acc[r][b][1]),
                                      V::mul(V::mul(s[r][b][1], k256), s1)));
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int h = 0; h < 2; ++h) {
      const int64_t j0 = (jb + b) * kNr + h * kL;
      if (j0 >= c.n) break;
      const int64_t nc = std::min<int64_t>(kL, c.n - j0);
      for (int r = 0; r < MR; ++r) V::store_row(c, i0 + r, j0, nc, V::load(acc[r][b][h]));
    }
}

/// The tiles [MR - 1][NB - 1] the walk can ask for under steps K (small, mid, main), else null.
template <class V, int Bits, class K>
struct TileTable {
  using Fn = void (*)(const Call&, int64_t, int64_t);
  static constexpr int kMaxRows = K::kMain.rows;
  static constexpr int kMaxBlocks = std::max({K::kSmall.blocks, K::kMid.blocks, K::kMain.blocks});
  template <int MR, int NB>
  static constexpr Fn fn() {
    constexpr bool used = (MR <= K::kSmall.rows && NB <= K::kSmall.blocks) ||
                          (MR <= K::kMid.rows && NB <= K::kMid.blocks) ||
                          (MR <= K::kMain.rows && NB <= K::kMain.blocks);
    if constexpr (used) return &tile<V, Bits, MR, NB>;
    else return nullptr;
  }
  static constexpr auto table = TileFnGrid<TileTable, Fn, kMaxRows, kMaxBlocks>::table;
};

/// The walk over V's tiles for codes of Bits bits, K's steps.
template <class V, int Bits, class K>
void walk(const Call& c, int64_t m) {
  const Steps st = m <= K::kSmall.rows ? K::kSmall : m <= K::kMid.rows ? K::kMid : K::kMain;
  constexpr int64_t kNr = 2 * V::kLanes;
  const int64_t blocks = (c.n + kNr - 1) / kNr, tiles = (m + st.rows - 1) / st.rows;
  const auto& table = TileTable<V, Bits, K>::table;
  for (int64_t jb = 0; jb < blocks; jb += st.blocks) {
    const int64_t nb = std::min<int64_t>(st.blocks, blocks - jb);
    for (int64_t t = 0, i0 = 0; t < tiles; ++t) {
      // Rows split evenly (9 rows by 8: 5 + 4, not 8 + 1: more FMA chains in the last tile).
      const int64_t rows = (m - i0 + (tiles - t) - 1) / (tiles - t);
      table[size_t(rows - 1)][size_t(nb - 1)](c, i0, jb);
      i0 += rows;
    }
  }
}

/// F8GemmUkernel::run_f32 over V's tiles, K's steps (static constexpr Steps kSmall, kMid,
/// kMain, by increasing rows); 4-bit codes when V has kCodes4.
template <class V, class K>
void run_f32(int64_t m, int64_t n, int64_t k, const F8Layout& w, const void* lhs, const void* rhs,
             float* dst, int64_t ld, const F8GemmEpilogue& ep) {
  static_assert(K::kSmall.rows <= K::kMid.rows && K::kMid.rows <= K::kMain.rows,
                "steps by increasing rows");
  using P = F8Packing<2 * V::kLanes, kKr, 4>;
  if (m <= 0 || n <= 0) return;
  Call c{{},
         static_cast<const float*>(lhs),
         static_cast<const uint8_t*>(rhs),
         P::padded_k(k),
         int64_t(P::block_bytes(k, w)),
         n,
         k,
         P::group_k(k, w),
         f8_groups(k, w),
         P::group_stride(k, w),
         dst,
         ld,
         ep,
         &w};
  if constexpr (V::kCodes4) {
    if (w.code_bits == 4) {
      f8_codebook_values(w, 1.0f / 256.0f, c.tbl);
      walk<V, 4, K>(c, m);
      V::finish(ep);
      return;
    }
  }
  walk<V, 8, K>(c, m);
  V::finish(ep);
}

}  // namespace f8_x86
}  // namespace
}  // namespace cpumoe
