// dtype.h: fp32 <-> f16 / bf16 conversions. The oracle and the op both round through these, so they
// are checked here against an independent rounding (in double) and against known bit patterns.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "cpumoe/dtype.h"

namespace {

using cpumoe::bf16_to_f32;
using cpumoe::DType;
using cpumoe::f16_to_f32;
using cpumoe::f32_bits;
using cpumoe::f32_from_bits;
using cpumoe::f32_to_bf16;
using cpumoe::f32_to_f16;

// A binary format with `precision` significand bits (implicit bit included), smallest normal
// exponent `emin` and largest exponent `emax`.
struct Format {
  int precision, emin, emax;
};
constexpr Format kHalf{11, -14, 15};
constexpr Format kBf16{8, -126, 127};

// Round-to-nearest-even of v to the format, from the definition: the quantum is 2^(max(e, emin) -
// precision + 1), a tie goes to the even multiple (nearbyint), and anything that rounds to
// 2^(emax+1) or beyond is infinity. Exact in double for every fp32 input.
double ref_round(double v, Format f) {
  if (v == 0.0 || !std::isfinite(v)) return v;
  int e2;
  std::frexp(std::fabs(v), &e2);  // |v| = m 2^e2, m in [0.5, 1): leading bit at 2^(e2 - 1)
  const int q = std::max(e2 - 1, f.emin) - (f.precision - 1);
  const double r = std::nearbyint(std::fabs(v) / std::ldexp(1.0, q)) * std::ldexp(1.0, q);
  const double out = r >= std::ldexp(1.0, f.emax + 1) ? std::numeric_limits<double>::infinity() : r;
  return std::copysign(out, v);
}

// binary16 decoded from its fields, in double: the independent check of f16_to_f32.
double ref_half_value(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v;
  if (exp == 0x1f) v = mant ? std::numeric_limits<double>::quiet_NaN()
                            : std::numeric_limits<double>::infinity();
  else if (exp == 0) v = std::ldexp(double(mant), -24);
  else v = std::ldexp(1.0 + mant / 1024.0, exp - 15);
  return sign ? -v : v;
}

bool is_half_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }
bool is_bf16_nan(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0; }

TEST(DType, SizesAndNames) {
  EXPECT_EQ(cpumoe::dtype_size(DType::f32), 4);
  EXPECT_EQ(cpumoe::dtype_size(DType::f16), 2);
  EXPECT_EQ(cpumoe::dtype_size(DType::bf16), 2);
  EXPECT_STREQ(cpumoe::dtype_name(DType::f32), "float32");
  EXPECT_STREQ(cpumoe::dtype_name(DType::f16), "float16");
  EXPECT_STREQ(cpumoe::dtype_name(DType::bf16), "bfloat16");
}

TEST(DType, HalfToFloatIsExactForAllHalfs) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = f16_to_f32(uint16_t(h));
    const double ref = ref_half_value(uint16_t(h));
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
    } else {
      ASSERT_EQ(double(f), ref) << std::hex << h;
      ASSERT_EQ(std::signbit(f), bool(h & 0x8000u)) << std::hex << h;  // -0 stays -0
    }
  }
}

TEST(DType, HalfRoundTripIsIdentityForAllHalfs) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint16_t back = f32_to_f16(f16_to_f32(uint16_t(h)));
    if (is_half_nan(uint16_t(h))) {
      ASSERT_TRUE(is_half_nan(back)) << std::hex << h << " -> " << back;
      ASSERT_EQ(back & 0x8000u, h & 0x8000u) << std::hex << h;
    } else {
      ASSERT_EQ(back, h) << std::hex << h;
    }
  }
}

TEST(DType, HalfKnownBitPatterns) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(0.1f), 0x2e66);
  EXPECT_EQ(f32_to_f16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);            // largest finite half
  EXPECT_EQ(f32_to_f16(65519.996f), 0x7bff);          // just below the rounding midpoint
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);            // midpoint: ties to even = inf
  EXPECT_EQ(f32_to_f16(1e10f), 0x7c00);               // overflow to inf
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::max()), 0xfc00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie between 0 and 2^-24: even = 0
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -26)), 0x0001);  // 0.75 ulp rounds up
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 ulp: tie, even = 2
  EXPECT_EQ(f32_to_f16(std::ldexp(1023.5f, -24)), 0x0400);  // subnormal rounds up into normal
  EXPECT_EQ(f32_to_f16(1e-40f), 0x0000);               // fp32 subnormal underflows to 0
  EXPECT_EQ(f32_to_f16(-1e-40f), 0x8000);
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie, even mantissa 0
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(3.0f, -11)), 0x3c02);  // tie, even mantissa 2
  EXPECT_TRUE(is_half_nan(f32_to_f16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(is_half_nan(f32_to_f16(f32_from_bits(0x7f800001u))));  // signalling, tiny payload
  EXPECT_TRUE(is_half_nan(f32_to_f16(f32_from_bits(0xffc00000u))));
  EXPECT_EQ(f32_to_f16(f32_from_bits(0xffc00000u)) & 0x8000u, 0x8000u);
}

TEST(DType, Bf16KnownBitPatterns) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(-1.0f), 0xbf80);
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x40490fdbu)), 0x4049);  // pi rounds down
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f808000u)), 0x3f80);  // tie, even
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f818000u)), 0x3f82);  // tie, even
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f808001u)), 0x3f81);  // above the tie
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to inf
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x7f7f7fffu)), 0x7f7f);        // stays the largest finite
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x00008000u)), 0x0000);  // subnormal tie to even 0
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x00018000u)), 0x0002);  // subnormal tie to even 2
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x007fffffu)), 0x0080);  // largest subnormal -> FLT_MIN
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  // NaNs stay NaN, including those whose upper half alone would read as infinity.
  EXPECT_TRUE(is_bf16_nan(f32_to_bf16(f32_from_bits(0x7f800001u))));
  EXPECT_TRUE(is_bf16_nan(f32_to_bf16(f32_from_bits(0x7f80ffffu))));
  EXPECT_TRUE(is_bf16_nan(f32_to_bf16(f32_from_bits(0xff800001u))));
  EXPECT_TRUE(is_bf16_nan(f32_to_bf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(f32_bits(bf16_to_f32(0x8001)), 0x80010000u);
  EXPECT_TRUE(std::isinf(bf16_to_f32(0xff80)));
}

TEST(DType, Bf16ExactForAllBf16) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    ASSERT_EQ(f32_bits(bf16_to_f32(uint16_t(h))), h << 16);
    const uint16_t back = f32_to_bf16(bf16_to_f32(uint16_t(h)));
    if (is_bf16_nan(uint16_t(h))) ASSERT_TRUE(is_bf16_nan(back)) << std::hex << h;
    else ASSERT_EQ(back, h) << std::hex << h;
  }
}

// Every rounding boundary of each format: the exact midpoint between two neighbours goes to the
// even one, one fp32 ulp either side goes to the nearer one.
TEST(DType, HalfRoundsToNearestEvenAtEveryMidpoint) {
  for (uint32_t h = 0; h < 0x7c00u; ++h) {  // positive finite halfs; h + 1 may be inf
    const double lo = ref_half_value(uint16_t(h));
    const double hi = h + 1 == 0x7c00u ? 65536.0 : ref_half_value(uint16_t(h + 1));
    const float mid = float((lo + hi) / 2);  // 12 significant bits: exact in fp32
    ASSERT_EQ(double(mid), (lo + hi) / 2);
    const uint16_t even = (h & 1u) ? uint16_t(h + 1) : uint16_t(h);
    for (float sign : {1.0f, -1.0f}) {
      const uint16_t s = sign < 0 ? 0x8000 : 0;
      ASSERT_EQ(f32_to_f16(sign * mid), s | even) << std::hex << h;
      ASSERT_EQ(f32_to_f16(sign * std::nextafter(mid, 0.0f)), s | h) << std::hex << h;
      ASSERT_EQ(f32_to_f16(sign * std::nextafter(mid, 1e30f)), s | (h + 1)) << std::hex << h;
    }
  }
}

TEST(DType, Bf16RoundsToNearestEvenAtEveryMidpoint) {
  for (uint32_t h = 0; h < 0x7f80u; ++h) {
    const uint32_t base = h << 16;
    const uint16_t even = (h & 1u) ? uint16_t(h + 1) : uint16_t(h);
    for (uint32_t s : {0u, 0x80000000u}) {
      const uint16_t hs = uint16_t(s >> 16);
      ASSERT_EQ(f32_to_bf16(f32_from_bits(s | base | 0x8000u)), hs | even) << std::hex << h;
      ASSERT_EQ(f32_to_bf16(f32_from_bits(s | base | 0x7fffu)), hs | h) << std::hex << h;
      ASSERT_EQ(f32_to_bf16(f32_from_bits(s | base | 0x8001u)), hs | (h + 1)) << std::hex << h;
    }
  }
}

// Random fp32 inputs against the definition of rounding: all bit patterns, and patterns whose
// exponent is in the interesting range of f16 (subnormal to overflow).
TEST(DType, RandomInputsMatchReferenceRounding) {
  std::mt19937 rng(1234);
  for (int i = 0; i < (1 << 18); ++i) {
    uint32_t u = rng();
    if (i & 1) u = (u & 0x807fffffu) | ((100u + rng() % 46u) << 23);  // 2^-27 .. 2^18
    const float f = f32_from_bits(u);
    if (std::isnan(f)) {
      ASSERT_TRUE(is_half_nan(f32_to_f16(f)));
      ASSERT_TRUE(is_bf16_nan(f32_to_bf16(f)));
      continue;
    }
    const double want_h = ref_round(f, kHalf);
    const double got_h = f16_to_f32(f32_to_f16(f));
    ASSERT_EQ(got_h, want_h) << std::hex << u;
    ASSERT_EQ(std::signbit(got_h), std::signbit(f)) << std::hex << u;
    const double want_b = ref_round(f, kBf16);
    ASSERT_EQ(double(bf16_to_f32(f32_to_bf16(f))), want_b) << std::hex << u;
  }
}

TEST(DType, LoadAndRoundToDtype) {
  const float f32s[] = {1.5f, -3.25f};
  const uint16_t f16s[] = {0x3c00, 0xc000};
  const uint16_t bf16s[] = {0x3f80, 0xc040};
  EXPECT_EQ(cpumoe::load_as_f32(f32s, DType::f32, 1), -3.25f);
  EXPECT_EQ(cpumoe::load_as_f32(f16s, DType::f16, 1), -2.0f);
  EXPECT_EQ(cpumoe::load_as_f32(bf16s, DType::bf16, 1), -3.0f);
  const float v = 0.1f;
  EXPECT_EQ(cpumoe::round_to_dtype(v, DType::f32), v);
  EXPECT_EQ(cpumoe::round_to_dtype(v, DType::f16), f16_to_f32(f32_to_f16(v)));
  EXPECT_EQ(cpumoe::round_to_dtype(v, DType::bf16), bf16_to_f32(f32_to_bf16(v)));
  EXPECT_NE(cpumoe::round_to_dtype(v, DType::f16), v);  // 0.1 is not a half
  EXPECT_NE(cpumoe::round_to_dtype(v, DType::bf16), v);
}

}  // namespace
