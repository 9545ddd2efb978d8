// The few AVX-512 intrinsics the kernels use that SIMDe 0.7.4 (Debian bookworm) lacks, written
// lane by lane from their definitions in Intel's intrinsics guide, over SIMDe's types, as macros
// in the way SIMDe's own native aliases are. Test-only (q4gemm_avx512_simde.cpp,
// f8gemm_avx512_simde.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace cpumoe_test {
namespace simde_shim {

inline simde__m512 cvtepi32_ps(simde__m512i a) {
  int32_t x[16];
  float y[16];
  std::memcpy(x, &a, 64);
  for (int i = 0; i < 16; ++i) y[i] = float(x[i]);  // round to nearest even, as vcvtdq2ps
  simde__m512 r;
  std::memcpy(&r, y, 64);
  return r;
}
// vpmovzxb*: the bytes of @p a zero-extended to the 64 / sizeof(Lane) lanes of a zmm.
template <class Lane, class In>
inline simde__m512i cvtepu8(In a) {
  constexpr int kN = 64 / int(sizeof(Lane));
  uint8_t x[kN];
  Lane y[kN];
  std::memcpy(x, &a, kN);
  for (int i = 0; i < kN; ++i) y[i] = x[i];
  simde__m512i r;
  std::memcpy(&r, y, 64);
  return r;
}
inline simde__mmask16 cmplt_epu32_mask(simde__m512i a, simde__m512i b) {
  uint32_t x[16], y[16];
  std::memcpy(x, &a, 64);
  std::memcpy(y, &b, 64);
  unsigned m = 0;
  for (int i = 0; i < 16; ++i) m |= unsigned(x[i] < y[i]) << i;
  return simde__mmask16(m);
}
// Lanes not in k from src; shift counts >= 32 give 0.
inline simde__m512i mask_sllv_epi32(simde__m512i src, simde__mmask16 k, simde__m512i a,
                                    simde__m512i cnt) {
  uint32_t s[16], x[16], c[16];
  std::memcpy(s, &src, 64);
  std::memcpy(x, &a, 64);
  std::memcpy(c, &cnt, 64);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) s[i] = c[i] >= 32 ? 0u : x[i] << c[i];
  simde__m512i r;
  std::memcpy(&r, s, 64);
  return r;
}
// Masked-off lanes are neither read nor written (and load as 0).
inline simde__m512 maskz_loadu_ps(simde__mmask16 k, const void* p) {
  float y[16] = {};
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) std::memcpy(&y[i], static_cast<const char*>(p) + 4 * i, 4);
  simde__m512 r;
  std::memcpy(&r, y, 64);
  return r;
}
inline void mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 a) {
  float y[16];
  std::memcpy(y, &a, 64);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) std::memcpy(static_cast<char*>(p) + 4 * i, &y[i], 4);
}
// Arithmetic right shift of each int32 lane (counts > 31 fill with the sign).
inline simde__m512i srai_epi32(simde__m512i a, unsigned cnt) {
  int32_t x[16];
  std::memcpy(x, &a, 64);
  const unsigned c = cnt > 31 ? 31 : cnt;
  for (int i = 0; i < 16; ++i) x[i] = x[i] >> c;  // arithmetic on int32 (C++20, and GCC before)
  simde__m512i r;
  std::memcpy(&r, x, 64);
  return r;
}
inline void stream_ps(void* p, simde__m512 a) { std::memcpy(p, &a, 64); }
// 16 fp16 -> fp32, exactly (vcvtph2ps: subnormals normalized, infinities and NaNs kept, a
// signaling NaN quieted).
inline simde__m512 cvtph_ps(simde__m256i a) {
  uint16_t x[16];
  float y[16];
  std::memcpy(x, &a, 32);
  for (int i = 0; i < 16; ++i) {
    const int e = (x[i] >> 10) & 31, m = x[i] & 1023;
    float v;
    if (e == 31) {
      v = m == 0 ? INFINITY : std::nanf("");
    } else {
      v = e == 0 ? std::ldexp(float(m), -24) : std::ldexp(float(1024 + m), e - 25);
    }
    y[i] = (x[i] & 0x8000) ? -v : v;
  }
  simde__m512 r;
  std::memcpy(&r, y, 64);
  return r;
}

// Bit i of the mask: 16-bit lane i of (a & b) is zero.
inline simde__mmask32 testn_epi16_mask(simde__m512i a, simde__m512i b) {
  uint16_t x[32], y[32];
  std::memcpy(x, &a, 64);
  std::memcpy(y, &b, 64);
  uint32_t m = 0;
  for (int i = 0; i < 32; ++i) m |= uint32_t((x[i] & y[i]) == 0) << i;
  return simde__mmask32(m);
}
// vdpbf16ps: per fp32 lane j, src + a[2j+1] b[2j+1] first, then + a[2j] b[2j], each a fused
// multiply-add rounded to nearest even; bf16 and src subnormals read as zero, subnormal results
// flushed. Checked against the hardware on a Zen 5 (3.2 M lanes of random bits, normal values
// and specials: every one bit-identical), where the pair-in-one-rounding and the even-first
// orders differ in 2-5% of lanes. Takes the bf16 operands as SIMDe integer vectors (the
// including file maps __m512bh to simde__m512i, so the kernels' casts stay as written).
inline float dpbf16_ftz(float x) {
  return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x;
}
inline simde__m512 dpbf16_ps(simde__m512 src, simde__m512i a, simde__m512i b) {
  float c[16];
  uint16_t x[32], y[32];
  std::memcpy(c, &src, 64);
  std::memcpy(x, &a, 64);
  std::memcpy(y, &b, 64);
  const auto bf = [](uint16_t h) {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return dpbf16_ftz(f);
  };
  for (int j = 0; j < 16; ++j) {
    const float t = dpbf16_ftz(std::fma(bf(x[2 * j + 1]), bf(y[2 * j + 1]), dpbf16_ftz(c[j])));
    c[j] = dpbf16_ftz(std::fma(bf(x[2 * j]), bf(y[2 * j]), t));
  }
  simde__m512 r;
  std::memcpy(&r, c, 64);
  return r;
}
}  // namespace simde_shim
}  // namespace cpumoe_test

#define _mm512_cvtepi32_ps(a) cpumoe_test::simde_shim::cvtepi32_ps(a)
#define _mm512_cvtepu8_epi32(a) cpumoe_test::simde_shim::cvtepu8<int32_t>(a)
#define _mm512_cvtepu8_epi16(a) cpumoe_test::simde_shim::cvtepu8<uint16_t>(a)
#define _mm512_cmplt_epu32_mask(a, b) cpumoe_test::simde_shim::cmplt_epu32_mask(a, b)
#define _mm512_mask_sllv_epi32(s, k, a, c) cpumoe_test::simde_shim::mask_sllv_epi32(s, k, a, c)
#define _mm512_maskz_loadu_ps(k, p) cpumoe_test::simde_shim::maskz_loadu_ps(k, p)
#define _mm512_mask_storeu_ps(p, k, a) cpumoe_test::simde_shim::mask_storeu_ps(p, k, a)
#define _mm512_stream_ps(p, a) cpumoe_test::simde_shim::stream_ps(p, a)
#define _mm512_srai_epi32(a, c) cpumoe_test::simde_shim::srai_epi32(a, c)
#define _mm512_cvtph_ps(a) cpumoe_test::simde_shim::cvtph_ps(a)
#define _mm512_testn_epi16_mask(a, b) cpumoe_test::simde_shim::testn_epi16_mask(a, b)
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(s, a, b) cpumoe_test::simde_shim::dpbf16_ps(s, a, b)
