// The logic of q4gemm_qs8rs_q4cio32x4_8x32_avx512_vnni, the W4A8 GEMM (int8 activations x int4 /
// mxfp4 codes with group scales) on AVX-512 VNNI. Its kernel file instantiates it, and so does the
// AMX W4A8 kernel (q4gemm_amx.h) for calls of few rows, on the same packing.
//
// vpdpbusd multiplies unsigned bytes by signed bytes. The weights are the unsigned side, A stays
// signed. B (`q4cio32x4`) is the `qs8ci16x4` operand shape (one int32 lane per column, 4
// consecutive k in its bytes) two to a byte: per 4 k of a 32-column block, 64 bytes, byte 4c + t
// holding column c's k 4q + t in its low nibble and column 16 + c's in its high nibble. int4
// codes are stored offset, u = v + 8 in both nibbles, so the raw byte is 16 u_hi + u_lo: itself
// an unsigned operand, with x & 0x0f the other one. Per row and 4 k, against one A broadcast:
//   Y = dpbusd(x & 0x0f) = sum a v_lo + 8 sum a,   X = dpbusd(x) = 16 sum a v_hi + 128 sum a + Y,
// and a group's accumulators start at -8 sum_g a (Y) and -136 sum_g a (X), so at the group end Y
// is the low columns' exact int32 sum and (X - Y) >> 4 the high columns': one `and` decodes 128
// weights. mxfp4 codes decode through vpshufb (u = 2 * E2M1 + 12 in [0, 24], both nibbles: and,
// shift + and, two vpshufb) and start at -12 sum_g a. int8_affine's 8-bit codes c need no decode:
// the byte is the unsigned operand, and both halves start at -128 sum_g a (value c - 128).
// vpdpbusd wraps; the true sums fit int32
// (|X| <= 136 * 128 * g up to kW4MaxGroup), so they come out exact. The row sums come with the
// packed A (`qs8rs`, per 32 k). The other way (A shifted to u8, signed weights) would need the
// weights' sums per column and group: one more vpdpbusd per weight vector.
//
// Layouts:
//   A (`qs8rs`, Q4LhsRowSums): row i at i * (kp + kp / 8): kp = round_up(k, 32) int8, then kp / 32
//      int32 sums of 32-k slices.
//   B (`q4cio32x4`, Q4Packing<32> + HalvesInNibbles): blocks of 32 columns; per group, per 4 k, 64
//      bytes as above; then the group's 32 scales (fp32 for int4, E8M0 bytes for mxfp4, decoded
//      here: the bytes read are what the format is for). 8-bit codes (HalvesInBytes): per 4 k,
//      128 bytes, the low half's 64 (byte 4c + t: column c, k 4q + t) then the high half's.
// Loop: per column step (4 blocks = 128 columns for up to 2 rows, 2 blocks for 3, else 1 block)
// and row tile (up to 2 / 3 / 8 rows, rows split evenly), per group: per 4 k, each block's 64 bytes loaded and decoded
// into two zmm, then per row its 4-byte A word broadcast and two vpdpbusd per block; at the group
// end, per row and block, (int4: sub, shift) cvt + mul by the group scales + add into the fp32
// accumulators (the exact order of q4gemm.h: no FMA). The int32 accumulators stay in registers
// over the group; the fp32 ones, touched once per group, in L1 (so the register tile can be 8
// rows). Decode (one row per expert) thus runs 4 independent weight streams with 1 (int4) or 5
// (mxfp4) vector ops per 64 weight bytes besides the 2 vpdpbusd, left to the hardware prefetcher;
// tiles of 3+ rows (one or two streams) prefetch kPrefetch bytes ahead in software. (On Zen 4 the
// software prefetch in the 4 streams cost time: m = 1, cold weights, 2 threads, 0.71x -> 0.58x of
// the W8A8 kernel's time without it; at m = 8 it still helps.)
// Epilogue: * lhs_scale, + bias, masked tail stores (nothing past n is written).
// Features used: AVX-512 F, BW, VL, VNNI.
#pragma once

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || \
    !defined(__AVX512VNNI__)
#error "q4gemm_avx512_vnni.h is for files built with -mavx512f -mavx512bw -mavx512vl -mavx512vnni"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpumoe/q4gemm.h"
#include "ukernels/common/x86/avx512_common.h"
#include "ukernels/q4gemm/x86/q4gemm_x86_common.h"

namespace cpumoe {
namespace {
namespace q4_vnni {


constexpr int64_t kNr = 32;
constexpr int64_t kHalf = 16;  // columns of one zmm of int32 sums
constexpr int64_t kQuadBytes = 64;  // 4 k of one block (4-bit codes; 8-bit: twice that)

// int8_affine's 8-bit codes: per 4 k of a block, 128 bytes (the `qs8ci16x4` shape for each half),
// byte 64 h + 4c + t holding column 16 h + c's code at k 4q + t, as given (unsigned).
struct HalvesInBytes {
  static int64_t index(int64_t c, int64_t kk, int64_t /*g*/) {
    return (kk / 4) * 2 * kQuadBytes + (c / kHalf) * kQuadBytes + 4 * (c % kHalf) + kk % 4;
  }
  static uint8_t code(uint8_t c) { return c; }
};
using Packing = Q4Packing<kNr, 1, HalvesInBytes>;
// Up to 2 rows (decode): 4 blocks per step (4 weight streams, 16 int32 accumulators: with 2 the
// memory stream ran 0.61x the W8A8 kernel's time at m = 1, with 4 0.52x); 3 rows: 2 blocks (12);
// more: 1 block, up to 8 rows (16 accumulators), so each decoded vector feeds up to 8 vpdpbusd.
// Besides them: 2 x NB decoded vectors, a broadcast, the mask and the table.
constexpr int64_t kMr = 8;
constexpr int kSmallRows = 2, kSmallBlocks = 4, kMidRows = 3, kMidBlocks = 2, kRows = 8,
              kBlocks = 1;
constexpr int64_t kPrefetch = 1024;  // bytes ahead in each block's stream (tiles of 3+ rows)

// Nibble position of column c's code kk of a group (the file comment's `q4cio32x4`).
struct HalvesInNibbles {
  static int64_t index(int64_t c, int64_t kk, int64_t /*g*/) {
    return 2 * ((kk / 4) * kQuadBytes + 4 * (c % kHalf) + kk % 4) + c / kHalf;
  }
};
// int4 codes stored as u = v + 8 (bit 3 of the two's-complement nibble flipped); mxfp4 as given.
struct OffsetInt4 {
  static uint8_t code(uint8_t c, int64_t /*idx*/, W4Format f) {
    return f == W4Format::int4 ? uint8_t(c ^ 8) : c;
  }
};

// What stays in registers over the call: the nibble mask and mxfp4's unsigned decode table.
struct Decode {
  __m512i mask, table;
  explicit Decode(W4Format f) {
    const int8_t* t = w4_decode_table(f);  // none for 8-bit codes
    alignas(16) int8_t u[16] = {};
    for (int c = 0; t != nullptr && c < 16; ++c) u[c] = int8_t(t[c] + 12);
    mask = _mm512_set1_epi8(0x0f);
    table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(u)));
  }
  // 64 code bytes (8-bit codes: 128) -> the unsigned operands of columns 0-15 (lo) and 16-31
  // (hi), 4 k each.
  template <Q4Codes C>
  void unpack(const uint8_t* p, __m512i& lo, __m512i& hi) const {
    const __m512i x = _mm512_loadu_si512(p);
    if constexpr (C == Q4Codes::bytes) {
      lo = x;
      hi = _mm512_loadu_si512(p + kQuadBytes);
    } else if constexpr (C == Q4Codes::mxfp4) {
      lo = _mm512_shuffle_epi8(table, _mm512_and_si512(x, mask));
      hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(x, 4), mask));
    } else {
      lo = _mm512_and_si512(x, mask);
      hi = x;
    }
  }
};

// 16 fp32 scales of one group of a block (at p: after its codes, or 16 scales further).
template <bool Mx>
inline __m512 load_scales(const uint8_t* p) {
  if constexpr (!Mx) {
    return _mm512_loadu_ps(p);
  } else {
    // E8M0 e -> 2^(e - 128) as w4_mxfp4_scale: (e - 1) << 23, e = 0, 1 subnormal, 255 NaN.
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m512i bits = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    bits = _mm512_mask_sllv_epi32(bits, _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)),
                                  _mm512_set1_epi32(0x00200000), e);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)),
                                 _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(bits);
  }
}

inline __m512i bcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);  // folded into vpdpbusd's {1to16} memory operand
}

// acc += u8 u x s8 s in acc's own register: with the intrinsic GCC rotates the accumulators
// through spare registers (a vmovdqa per vpdpbusd in the tile loop).
// (The SIMDe build of this file for tests, tests_cpp/avx512emu, takes the intrinsic.)
inline void dpbusd(__m512i& acc, __m512i u, __m512i s) {
#if defined(SIMDE_ENABLE_NATIVE_ALIASES)
  acc = _mm512_dpbusd_epi32(acc, u, s);
#else
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
#endif
}

// The kernel as run_q4_f32 (q4gemm_x86_common.h) takes it: the walk's steps and the tile.
// PfSmall: software prefetch in the 1-2-row tiles too (the AMX kernel's few-row calls, measured
// on Sapphire Rapids with it; see the file comment for Zen 4).
template <bool PfSmall>
struct Kernel : Q4X86Steps<Packing, kSmallRows, kSmallBlocks, kMidRows, kMidBlocks, kRows,
                           kBlocks, Decode> {
  template <int MR, int NB, Q4Codes C, int G>
  static void tile(const Q4Call<Decode>& c, int64_t i0, int64_t jb);
};

// Rows [i0, i0 + MR) of A x blocks [jb, jb + NB) of B; G: the group size when known at compile
// time (run_q4_f32's list: the quad loop's count and the row sums fixed), else 0.
template <bool PfSmall>
template <int MR, int NB, Q4Codes C, int G>
void Kernel<PfSmall>::tile(const Q4Call<Decode>& c, int64_t i0, int64_t jb) {
  const auto [a, bp, lda, bstride, g, groups, gbytes, cbytes] = q4_tile_span<Packing, G>(c, i0, jb);
  constexpr bool Mx = C == Q4Codes::mxfp4, Bytes = C == Q4Codes::bytes;
  constexpr int64_t kStep = Bytes ? 2 * kQuadBytes : kQuadBytes;  // code bytes per 4 k
  const int64_t hbytes = kHalf * c.w.scale_bytes();  // the high half's scales after the low's
  // Start values per unit of the group's row sum: lo and hi (see the file comment).
  constexpr uint32_t kLoOff = Mx ? 12 : Bytes ? 128 : 8, kHiOff = Mx ? 12 : Bytes ? 128 : 136;
  alignas(64) float acc[MR][NB][2][kHalf] = {};
  __m512i lo[MR][NB], hi[MR][NB];
  for (int64_t gi = 0; gi < groups; ++gi) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const uint32_t sum = uint32_t(Q4LhsRowSums::group_sum(a + r * lda, c.kp, gi, g));
      const __m512i l0 = _mm512_set1_epi32(int32_t(0u - kLoOff * sum));
      const __m512i h0 = _mm512_set1_epi32(int32_t(0u - kHiOff * sum));
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) lo[r][b] = l0, hi[r][b] = h0;
    }
    const uint8_t* grp = bp + gi * gbytes;
    const int8_t* ag = reinterpret_cast<const int8_t*>(a) + gi * g;
    for (int64_t q = 0; q < g / 4; ++q) {
      // Every block's quad decoded first, then row by row (one broadcast live at a time).
      __m512i dlo[NB], dhi[NB];
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        const uint8_t* p = grp + b * bstride + q * kStep;
        if constexpr (PfSmall || MR > kSmallRows) {
          _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
          if constexpr (Bytes)
            _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + kQuadBytes), _MM_HINT_T0);
        }
        c.dec.template unpack<C>(p, dlo[b], dhi[b]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512i a0 = bcast(ag + r * lda + 4 * q);
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) {
          dpbusd(lo[r][b], dlo[b], a0);
          dpbusd(hi[r][b], dhi[b], a0);
        }
      }
    }
    const float* gs = c.ep.lhs_group_scale;  // per row and group, or none
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const uint8_t* sp = grp + b * bstride + cbytes;
      const __m512 slo = load_scales<Mx>(sp), shi = load_scales<Mx>(sp + hbytes);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        __m512i h = hi[r][b];
        if constexpr (C == Q4Codes::int4) h = _mm512_srai_epi32(_mm512_sub_epi32(h, lo[r][b]), 4);
        __m512 fl = _mm512_mul_ps(_mm512_cvtepi32_ps(lo[r][b]), slo);
        __m512 fh = _mm512_mul_ps(_mm512_cvtepi32_ps(h), shi);
        if (gs) {
          const __m512 ga = _mm512_set1_ps(gs[(i0 + r) * groups + gi]);
          fl = _mm512_mul_ps(fl, ga);
          fh = _mm512_mul_ps(fh, ga);
        }
        _mm512_store_ps(acc[r][b][0], _mm512_add_ps(_mm512_load_ps(acc[r][b][0]), fl));
        _mm512_store_ps(acc[r][b][1], _mm512_add_ps(_mm512_load_ps(acc[r][b][1]), fh));
      }
    }
  }
  const StoreF32Acc store{c.dst, c.ld, c.ep.bias, c.ep.stream_dst};
  for (int b = 0; b < NB; ++b)
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t c0 = jb * kNr + kNr * b + kHalf * hf;
      if (c0 >= c.n) break;
      const int64_t nc = std::min<int64_t>(kHalf, c.n - c0);
      for (int r = 0; r < MR; ++r)
        store(i0 + r, c0, nc,
              _mm512_mul_ps(_mm512_load_ps(acc[r][b][hf]),
                            _mm512_set1_ps(c.ep.lhs_scale[i0 + r])));
    }
}

template <bool PfSmall = false>
void run_f32(int64_t m, int64_t n, int64_t k, const W4Layout& w, const void* lhs,
             const void* rhs, float* dst, int64_t dst_stride, const Q4GemmEpilogue& ep) {
  run_q4_f32<Kernel<PfSmall>>(m, n, k, w, lhs, rhs, dst, dst_stride, ep);
  if (ep.stream_dst) _mm_sfence();  // the non-temporal stores visible before the call returns
}

}  // namespace q4_vnni
}  // namespace
}  // namespace cpumoe
