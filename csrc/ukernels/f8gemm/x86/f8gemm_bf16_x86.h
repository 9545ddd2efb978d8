// What the x86 f8gemm kernels that multiply in bf16 share (VDPBF16PS:
// f8gemm_bf16r_f8ci32x2_12x32_avx512_bf16.cpp; AMX TDPBF16PS: f8gemm_amx.h): the packed B's code
// arrangement, the exact E4M3 -> bf16 decode of one vector, and the expansion of a block's codes
// into a bf16 panel in the caller's scratch.
//
// Codes (`f8ci32x2`, F8Interleaved<32, 2>): per group of a block of 32 columns, one 64-byte step
// per k pair, column c's two codes at 2c (columns 0-15 in the first 32 bytes, 16-31 in the next):
// 32 bytes are one bf16 operand of VDPBF16PS (16 columns x 2 k, one 32-bit lane per column) and
// one 64-byte row of an AMX B tile. Scales as given (KeepF8).
//
// Decode, exact, in 6 instructions per 32 weights with no lane crossing (no fp32 step): a code's
// value times 2^-8 as bf16. For a normal code (exponent field e >= 1) that is the sign, the bf16
// exponent field e + 112 and the 3 mantissa bits: the sign-extended code shifted left by 4,
// masked, and 112 << 7 or-ed in (vpmovsxbw with the load, vpsllw, vpternlogd). The 7 subnormal
// magnitudes m 2^-9 (times 2^-8: down to 2^-17, still a bf16 normal, which matters: the bf16
// hardware paths read bf16 subnormals as zero) come from an 8-entry table in a register
// (vpermw under the mask of exponent field 0, vptestnmw), and the sign is or-ed back in
// (vpternlogd). The results equal the fp16 route of f8gemm_x86.h (vcvtph2ps and vcvtne2ps2bf16
// would take 7 instructions, three of them conversions: 0.65x the rate on Zen 5). The 2^8
// comes back per group, (S * 256) * s, as in the fp32 kernels: any finite scale works.
//
// 4-bit codes (W4A16, F8Layout::code_bits 4): Codes<4> below, the same operands from half the
// bytes.
//
// Panel (the expansion): block b's codes over the whole padded depth kp, decoded once into
// scratch as two halves of 16 columns, half h at panel + h * 32 kp bytes, k pair q at + 64 q:
// `bf16ci16x2` per half (bgemm's VDPBF16PS operand). Group g's pairs start at pair g * gk / 2.
// f8gemm_amx.h expands group by group in the same layout: with the group padded to 32 k, each
// half is then 1 KB AMX B tiles one after the other.
// Internal linkage on purpose (see qgemm/qgemm_common.h): each kernel file has its own ISA flags.
#pragma once

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512BF16__)
#error "f8gemm_bf16_x86.h is for files built with the avx512_bf16 (or amx) level's flags only"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpumoe/f8gemm.h"
#include "ukernels/f8gemm/f8gemm_common.h"

namespace cpumoe {
namespace {
namespace f8_bf16 {

constexpr int64_t kNr = 32;         // columns of a packed block: two vectors of 16 columns
constexpr int64_t kPairBytes = 64;  // a block's codes of one k pair; one panel half's bf16 too
/// Software prefetch distances in a block's code stream, bytes: decoding in registers (the
/// few-row tiles; Zen 5, the Qwen3-30B-A3B layer with cold weights, one thread, T = 1: 0.97 ms at
/// 2 KiB, 1.02 at 4 KiB, 1.12 at 1 KiB), and expanding into a panel (T = 512: 86 ms at 4 to 16
/// KiB, 101 at 2 KiB; the expansion is spread over the row tiles, so it reads more slowly).
constexpr int64_t kPrefetch = 2048;
constexpr int64_t kPrefetchExpand = 8192;

/// The codes' arrangement within a group (pack_rhs_f8's Arrange).
using Arrange = F8Interleaved<kNr, 2>;

/// Bytes of a panel half (16 columns) of padded depth @p kp, and of the whole panel.
inline int64_t half_bytes(int64_t kp) { return 32 * kp; }
inline size_t panel_bytes(int64_t kp) { return size_t(64) * size_t(kp); }

/// The 32 codes at @p p (16 columns x one k pair, column c's pair at 2c) -> the bf16 of their
/// values times 2^-8, in the same order: a VDPBF16PS operand (the file comment).
inline __m512i decode16x2(const uint8_t* p) {
  // bf16 of a normal code's value times 2^-8: sign, the exponent field e + 112, the 3 mantissa
  // bits, so the sign-extended code shifted left by 4, masked, with 112 << 7 or-ed in.
  const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  __m512i y = _mm512_ternarylogic_epi32(_mm512_slli_epi16(x, 4), _mm512_set1_epi16(short(0x87F0)),
                                        _mm512_set1_epi16(0x3800), 0xEA);  // (a & b) | c
  // Subnormal codes (exponent field 0, bits 6-3 clear): the bf16 of m 2^-17 from a table indexed
  // by the low 5 bits (the mantissa m), then the sign or-ed back in (a | (b & c)).
  const __m512i sub = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       0, 0, 0, 0, 0x3860, 0x3840, 0x3820, 0x3800, 0x37C0, 0x3780,
                                       0x3700, 0);
  y = _mm512_mask_permutexvar_epi16(y, _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x78)), x, sub);
  return _mm512_ternarylogic_epi32(y, x, _mm512_set1_epi16(short(0x8000)), 0xF8);
}

/// The 32-word decode table of @p w's codebook (Codes<4>), zero for 8-bit codes.
inline __m512i codebook_table(const F8Layout& w) {
  alignas(64) uint16_t t[32] = {};
  if (w.code_bits == 4) {
    float v[16];
    f8_codebook_values(w, 1.0f / 256.0f, v);
    for (int i = 0; i < 32; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &v[i & 15], 4);
      t[i] = uint16_t(bits >> 16);  // exact: E4M3 values have 4 significant bits
    }
  }
  return _mm512_load_si512(t);
}

/// A kernel call's weight codes (F8Layout::code_bits): Bits 8, the E4M3 codes (decode16x2); Bits
/// 4, codebook indices, two per byte (F8Packing's nibble span 32: byte j of a 32-byte step holds
/// position j in its low nibble and position 32 + j in its high one, so one step is the 64
/// positions of an 8-bit k pair step), looked up in a 32-word table of the codebook's bf16 values
/// times 2^-8 (entries i and i + 16 alike: the index's bit 4 is the other nibble's bit 0), 4
/// instructions per 64 weights (vpmovzxbw with the load, vpsrlw, two vpermw) where 8-bit codes
/// take 12. The same bf16 values, so the same bits.
template <int Bits>
struct Codes {
  static_assert(Bits == 8 || Bits == 4, "E4M3 codes or 4-bit indices");
  /// Code bytes of one k pair step of a block.
  static constexpr int64_t kStep = Bits * 8;
  __m512i tbl;  ///< Bits 4: codebook_table's
  /// The step at @p p -> the VDPBF16PS operands of columns 0-15 (@p w0) and 16-31 (@p w1).
  void decode(const uint8_t* p, __m512i& w0, __m512i& w1) const {
    if constexpr (Bits == 8) {
      w0 = decode16x2(p);
      w1 = decode16x2(p + 32);
    } else {
      const __m512i x =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      w0 = _mm512_permutexvar_epi16(x, tbl);
      w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(x, 4), tbl);
    }
  }
};

/// Decodes the block at @p blk (all groups, padded to kr with zero codes) into @p panel (64-byte
/// aligned, panel_bytes(kp)): the layout above. Every byte of the panel up to kp is written.
template <class P, int Bits>
inline void expand(const uint8_t* blk, const F8Call& c, const Codes<Bits>& codes, uint8_t* panel) {
  constexpr int64_t kStep = Codes<Bits>::kStep;
  uint8_t* h1 = panel + half_bytes(c.kp);
  for (int64_t g = 0; g < c.groups; ++g) {
    const uint8_t* grp = blk + g * c.gstride;
    const int64_t pairs = P::group_kp(g, c.k, *c.w) / 2, q0 = g * c.gk / 2;
    for (int64_t q = 0; q < pairs; ++q) {
      _mm_prefetch(reinterpret_cast<const char*>(grp + q * kStep + kPrefetchExpand),
                   _MM_HINT_T0);
      __m512i b0, b1;
      codes.decode(grp + q * kStep, b0, b1);
      _mm512_store_si512(panel + (q0 + q) * kPairBytes, b0);
      _mm512_store_si512(h1 + (q0 + q) * kPairBytes, b1);
    }
  }
}

/// The 32 scales of group @p g of the block at @p blk (F8Packing: after the group's codes).
template <class P>
inline const uint8_t* group_scales(const uint8_t* blk, const F8Call& c, int64_t g) {
  return blk + g * c.gstride + P::codes_bytes(P::group_kp(g, c.k, *c.w), *c.w);
}

}  // namespace f8_bf16
}  // namespace
}  // namespace cpumoe
