// The AMX tile model against the hardware and the naive sums, and the kernels' tile scope (the
// thread's tile configuration survives a call). The model kernels themselves run the registry
// testers in this binary (test_qgemm.cpp, test_bgemm.cpp, test_q4gemm.cpp, test_f8gemm.cpp built
// with CPUMOE_TEST_AMX_TILE_MODEL).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "amx/amx_model_kernels.h"
#include "amx/amx_probe.h"
#include "cpumoe/cpu_features.h"
#include "cpumoe/dtype.h"
#include "cpumoe/qgemm.h"

namespace {

using cpumoe::Isa;

struct alignas(64) Tile64 {
  uint8_t b[16][64];
};

// Random bytes, with the extremes (0, 255 / -128, 127) in a few places.
void fill_bytes(Tile64& t, std::mt19937& rng) {
  for (auto& row : t.b)
    for (auto& v : row) v = uint8_t(rng());
  t.b[0][0] = 255;
  t.b[0][1] = 0;
  t.b[15][63] = 128;
  t.b[7][5] = 127;
}

// bf16 values of moderate exponent (no overflow), some subnormal, some zero, random signs.
void fill_bf16(Tile64& t, std::mt19937& rng, bool subnormals) {
  for (auto& row : t.b)
    for (int j = 0; j < 32; ++j) {
      uint16_t h = uint16_t((rng() & 0x807f) | ((rng() % 24 + 116) << 7));
      if (subnormals && rng() % 11 == 0) h &= 0x807f;  // exponent 0: subnormal or zero
      std::memcpy(&row[2 * j], &h, 2);
    }
}

// The model's code is built with the avx512_bf16 level's flags (as the AMX kernels' epilogues
// are): on a CPU without them, running it would be an illegal instruction.
#define CPUMOE_SKIP_WITHOUT_MODEL_ISA()                                           \
  if (!cpumoe::cpu_supports(Isa::avx512_bf16))                                    \
  GTEST_SKIP() << "the tile model is AVX-512 code; this CPU lacks avx512_bf16"

TEST(AmxTileModel, Int8DotIsTheNaiveWrappingSum) {
  CPUMOE_SKIP_WITHOUT_MODEL_ISA();
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    Tile64 a, b, c, want;
    fill_bytes(a, rng);
    fill_bytes(b, rng);
    fill_bytes(c, rng);
    if (trial == 0) {  // the largest sums: 64 * 255 * -128 on top of INT32_MIN-ish values wrap
      std::memset(a.b, 255, sizeof(a.b));
      std::memset(b.b, 128, sizeof(b.b));
    }
    std::memcpy(&want, &c, sizeof(c));
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        uint32_t acc;
        std::memcpy(&acc, &want.b[m][4 * n], 4);
        for (int k = 0; k < 64; ++k)
          acc += uint32_t(int32_t(a.b[m][k]) * int32_t(int8_t(b.b[k / 4][4 * n + k % 4])));
        std::memcpy(&want.b[m][4 * n], &acc, 4);
      }
    cpumoe_test::amx_model_dpbusd(a.b, b.b, c.b);
    ASSERT_EQ(std::memcmp(&c, &want, sizeof(c)), 0) << "trial " << trial;
  }
}

TEST(AmxTileModel, Bf16DotPairsFlushSubnormals) {
  CPUMOE_SKIP_WITHOUT_MODEL_ISA();
  // One pair, hand-checked: (1.5 * 2 + 0.25 * -4) added to 10 is 12; a subnormal bf16 input is 0.
  Tile64 a{}, b{}, c{};
  const uint16_t one_half = cpumoe::f32_to_bf16(1.5f), two = cpumoe::f32_to_bf16(2.0f),
                 quarter = cpumoe::f32_to_bf16(0.25f), m4 = cpumoe::f32_to_bf16(-4.0f);
  std::memcpy(&a.b[3][0], &one_half, 2);
  std::memcpy(&a.b[3][2], &quarter, 2);
  std::memcpy(&b.b[0][4 * 5], &two, 2);
  std::memcpy(&b.b[0][4 * 5 + 2], &m4, 2);
  const float ten = 10.0f;
  std::memcpy(&c.b[3][4 * 5], &ten, 4);
  const uint16_t sub = 0x0001;  // the smallest subnormal bf16, times 2^100 would be normal
  const uint16_t big = cpumoe::f32_to_bf16(std::ldexp(1.0f, 100));
  std::memcpy(&a.b[4][0], &sub, 2);
  std::memcpy(&b.b[0][0], &big, 2);
  cpumoe_test::amx_model_dpbf16ps(a.b, b.b, c.b, 1);
  float got;
  std::memcpy(&got, &c.b[3][4 * 5], 4);
  EXPECT_EQ(got, 12.0f);
  std::memcpy(&got, &c.b[4][0], 4);
  EXPECT_EQ(got, 0.0f) << "a subnormal bf16 input counts as zero";
}

// The model is what the hardware does: int8 (tdpbusd, tdpbssd) bit for bit; bf16 bit for bit
// for one k pair, and within the fp32 summation bound for a whole tile (the hardware's own
// grouping of roundings).
TEST(AmxTileModel, MatchesTheHardware) {
#if !defined(CPUMOE_TEST_AMX_HW)
  GTEST_SKIP() << "this build has no AMX kernels";
#else
  if (!cpumoe::cpu_supports(Isa::amx)) GTEST_SKIP() << "this CPU has no AMX";
  std::mt19937 rng(11);
  for (int trial = 0; trial < 50; ++trial) {
    Tile64 a, b, c, hw, model;
    fill_bytes(a, rng);
    fill_bytes(b, rng);
    fill_bytes(c, rng);
    std::memcpy(&hw, &c, sizeof(c));
    std::memcpy(&model, &c, sizeof(c));
    cpumoe_test::amx_hw_dpbusd(a.b, b.b, hw.b);
    cpumoe_test::amx_model_dpbusd(a.b, b.b, model.b);
    ASSERT_EQ(std::memcmp(&hw, &model, sizeof(hw)), 0) << "tdpbusd, trial " << trial;
    std::memcpy(&hw, &c, sizeof(c));
    std::memcpy(&model, &c, sizeof(c));
    cpumoe_test::amx_hw_dpbssd(a.b, b.b, hw.b);
    cpumoe_test::amx_model_dpbssd(a.b, b.b, model.b);
    ASSERT_EQ(std::memcmp(&hw, &model, sizeof(hw)), 0) << "tdpbssd, trial " << trial;
  }
  for (int pairs : {1, 16}) {
    for (int trial = 0; trial < 50; ++trial) {
      Tile64 a, b, c{}, hw, model;
      fill_bf16(a, rng, trial % 2 == 1);
      fill_bf16(b, rng, trial % 2 == 1);
      for (auto& row : c.b)
        for (int j = 0; j < 16; ++j) {
          const float v = float(int(rng() % 2001) - 1000) / 7.0f;
          std::memcpy(&row[4 * j], &v, 4);
        }
      std::memcpy(&hw, &c, sizeof(c));
      std::memcpy(&model, &c, sizeof(c));
      cpumoe_test::amx_hw_dpbf16ps(a.b, b.b, hw.b, pairs);
      cpumoe_test::amx_model_dpbf16ps(a.b, b.b, model.b, pairs);
      if (pairs == 1) {
        ASSERT_EQ(std::memcmp(&hw, &model, sizeof(hw)), 0) << "tdpbf16ps, one pair, trial " << trial;
        continue;
      }
      for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) {
          float h, md, c0;
          std::memcpy(&h, &hw.b[m][4 * n], 4);
          std::memcpy(&md, &model.b[m][4 * n], 4);
          std::memcpy(&c0, &c.b[m][4 * n], 4);
          double mag = std::fabs(c0);
          for (int k = 0; k < 2 * pairs; ++k) {
            uint16_t x, y;
            std::memcpy(&x, &a.b[m][2 * k], 2);
            std::memcpy(&y, &b.b[k / 2][4 * n + 2 * (k % 2)], 2);
            mag += std::fabs(double(cpumoe::bf16_to_f32(x)) * cpumoe::bf16_to_f32(y));
          }
          const double bound = 2.0 * (2 * pairs + 2) * std::ldexp(1.0, -24) * mag + 1e-30;
          ASSERT_LE(std::fabs(double(h) - double(md)), bound) << "tdpbf16ps [" << m << "][" << n << "]";
        }
    }
  }
#endif
}

// A call leaves the calling thread's tile configuration as it found it: a caller that keeps
// AMX configured between its own calls (oneDNN does, inside torch) is not disturbed, and a
// thread without one is left without one.
TEST(AmxTileScope, KernelRestoresTheCallersConfiguration) {
  CPUMOE_SKIP_WITHOUT_MODEL_ISA();
  alignas(64) uint8_t theirs[64] = {}, after[64], zero[64] = {};
  theirs[0] = 1;                      // palette 1
  theirs[16] = 32, theirs[48] = 4;    // tile 0: 4 rows x 32 bytes
  theirs[18] = 64, theirs[49] = 16;   // tile 1: 16 x 64
  cpumoe_test::amx_model_loadconfig(theirs);
  EXPECT_EQ(cpumoe_test::amx_model_run_int8_once(), 64.0f);
  cpumoe_test::amx_model_storeconfig(after);
  EXPECT_EQ(std::memcmp(after, theirs, 64), 0) << "model: the caller's configuration was lost";
  cpumoe_test::amx_model_loadconfig(zero);  // palette 0: release
  EXPECT_EQ(cpumoe_test::amx_model_run_int8_once(), 64.0f);
  cpumoe_test::amx_model_storeconfig(after);
  EXPECT_EQ(std::memcmp(after, zero, 64), 0) << "model: a thread without tiles was left configured";
#if defined(CPUMOE_TEST_AMX_HW)
  const cpumoe::QGemmUkernel* k = cpumoe::qgemm_find("qgemm_qu8r_qs8ci16x4s_16x16_amx");
  if (k == nullptr || !cpumoe::cpu_supports(Isa::amx)) return;
  // The real kernel, 32 x 32 x 64 of ones, after the caller configured its own shapes.
  const int64_t m = 32, n = 32, kk = 64;
  static int8_t ones8[m * kk];
  std::memset(ones8, 1, sizeof(ones8));
  const int8_t* rows[m];
  for (int64_t i = 0; i < m; ++i) rows[i] = ones8 + i * kk;
  alignas(64) static uint8_t lhs[1 << 14], rhs[1 << 14];
  ASSERT_LE(k->lhs_packed_size(m, kk), sizeof(lhs));
  ASSERT_LE(k->rhs_packed_size(n, kk), sizeof(rhs));
  k->pack_lhs(m, kk, rows, lhs);
  k->pack_rhs(n, kk, ones8, kk, rhs);
  float scale[m], out[m * n];
  for (auto& s : scale) s = 1.0f;
  for (const uint8_t* cfg : {static_cast<const uint8_t*>(theirs), static_cast<const uint8_t*>(zero)}) {
    if (cfg[0] != 0) cpumoe_test::amx_hw_loadconfig(cfg);
    else cpumoe_test::amx_hw_release();
    k->run_f32(m, n, kk, lhs, rhs, out, n, {scale, scale, nullptr});
    EXPECT_EQ(out[0], 64.0f);
    EXPECT_EQ(out[m * n - 1], 64.0f);
    cpumoe_test::amx_hw_storeconfig(after);
    EXPECT_EQ(std::memcmp(after, cfg, 64), 0) << "hardware: palette " << int(cfg[0]);
  }
  cpumoe_test::amx_hw_release();
#endif
}

}  // namespace
