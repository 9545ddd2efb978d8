// The BF16 op on FP8 weights (PackedMoeFp8 + fused_moe_bf16) against the naive oracle, for
// every f8gemm kernel this CPU runs: a grid of shapes, block shapes (DeepSeek's 128 x 128,
// blocks that end partial, per channel), activations, dtypes and routings; determinism across
// thread counts and across the fused / phased task split; expert map. The problems are those of
// the int8 tests with the weights re-quantized to E4M3 in blocks (same magnitudes, every
// activation region reached).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpumoe/moe.h"
#include "moe_test_util.h"
#include "reference/reference.h"

namespace {

using cpumoe::Activation;
using cpumoe::DType;
using cpumoe_test::make_moe_data;
using cpumoe_test::MoeData;
using cpumoe_test::MoeShape;

// As the BF16 op's test: the kernels' fp32 sums within a block in their own order against the
// oracle's double ones can flip a bf16 rounding of one activation element.
constexpr double kTol = 1e-2;

using cpumoe_ref::e4m3_code;

struct Fp8Data {
  MoeData d;
  cpumoe_ref::MoeProblemFp8 ref;
};

// One [N, K] matrix of real weights w(n, k) as codes [N, K] and block scales amax / 448.
void quantize(int64_t N, int64_t K, int64_t bn, int64_t bk,
              const std::function<float(int64_t, int64_t)>& w, std::vector<uint8_t>* codes,
              std::vector<float>* scales) {
  const int64_t gk = bk == 0 || bk >= K ? K : bk;
  const int64_t rows = (N + bn - 1) / bn, groups = (K + gk - 1) / gk;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float amax = 0.0f;
      for (int64_t n = r * bn; n < std::min(N, (r + 1) * bn); ++n)
        for (int64_t k = g * gk; k < std::min(K, (g + 1) * gk); ++k)
          amax = std::max(amax, std::fabs(w(n, k)));
      const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
      scales->push_back(s);
      for (int64_t n = r * bn; n < std::min(N, (r + 1) * bn); ++n)
        for (int64_t k = g * gk; k < std::min(K, (g + 1) * gk); ++k)
          (*codes)[size_t(n * K + k)] = e4m3_code(w(n, k) / s);
    }
}

// The int8 problem's weights (w * channel scale) as E4M3 in blocks of bn x bk.
Fp8Data to_fp8(MoeData d, int64_t bn, int64_t bk) {
  Fp8Data f;
  const auto& r = d.ref;
  f.ref.E = r.E;
  f.ref.H = r.H;
  f.ref.I = r.I;
  f.ref.block_n = bn;
  f.ref.block_k = bk;
  f.ref.w13.resize(r.w13.size());
  f.ref.w2.resize(r.w2.size());
  const int64_t H = r.H, I = r.I;
  for (int64_t e = 0; e < r.E; ++e) {
    std::vector<uint8_t> c13(size_t(2 * I * H)), c2(size_t(H * I));
    quantize(2 * I, H, bn, bk, [&](int64_t n, int64_t k) {
      return float(r.w13[size_t((e * 2 * I + n) * H + k)]) * r.s13[size_t(e * 2 * I + n)];
    }, &c13, &f.ref.s13);
    quantize(H, I, bn, bk, [&](int64_t n, int64_t k) {
      return float(r.w2[size_t((e * H + n) * I + k)]) * r.s2[size_t(e * H + n)];
    }, &c2, &f.ref.s2);
    std::copy(c13.begin(), c13.end(), f.ref.w13.begin() + e * 2 * I * H);
    std::copy(c2.begin(), c2.end(), f.ref.w2.begin() + e * H * I);
  }
  f.ref.b13 = r.b13;
  f.ref.b2 = r.b2;
  f.d = std::move(d);
  return f;
}

cpumoe::MoeWeightsFp8 weights_of(const Fp8Data& f) {
  auto w = f.d.sized_weights<cpumoe::MoeWeightsFp8>();
  w.block_n = f.ref.block_n;
  w.block_k = f.ref.block_k;
  w.w13 = f.ref.w13.data();
  w.w2 = f.ref.w2.data();
  w.s13 = f.ref.s13.data();
  w.s2 = f.ref.s2.data();
  return w;
}

std::vector<const cpumoe::F8GemmUkernel*> supported_f8_kernels() {
  return cpumoe_test::supported_kernels(cpumoe::f8gemm_registry());
}

double g_worst = 0.0;

void check_all_kernels(const Fp8Data& f) {
  const MoeData& d = f.d;
  SCOPED_TRACE(d.describe() + " block=" + std::to_string(f.ref.block_n) + "x" +
               std::to_string(f.ref.block_k));
  const std::vector<float> want = cpumoe_ref::fused_moe_fp8(f.ref, d.ref_inputs());
  g_worst = std::max(g_worst, cpumoe_test::check_kernels<cpumoe::PackedMoeFp8>(
                                  supported_f8_kernels(), weights_of(f), d, want, kTol));
}

// The block shapes of the grid: DeepSeek's, one that leaves partial blocks on every test width,
// small square ones, per channel (bk 0) and per tensor-ish (bn and bk beyond every size).
constexpr int64_t kBlocks[][2] = {{128, 128}, {3, 32}, {32, 32}, {1, 0}, {4096, 4096}};

class MoeFp8GridTest : public testing::TestWithParam<cpumoe_test::GridParam> {};

TEST_P(MoeFp8GridTest, MatchesOracle) {
  const auto [act, dtype] = GetParam();
  const uint32_t param = 3 * uint32_t(act.kind) + uint32_t(dtype);
  cpumoe_test::bf16_op_grid(GetParam(), 9000, "fp8", supported_f8_kernels().size(), g_worst,
                            [&](MoeData d, uint32_t i) {
                              const auto* b = kBlocks[(i + param) % 5];
                              check_all_kernels(to_fp8(std::move(d), b[0], b[1]));
                            });
}

INSTANTIATE_TEST_SUITE_P(All, MoeFp8GridTest, cpumoe_test::grid_params(),
                         cpumoe_test::grid_name);

// Real layer widths (K up to 2880 with 128-blocks that end partial) and the fused / phased task
// splits giving the same bits.
TEST(MoeFp8, WideLayersAndTaskSplits) {
  for (MoeShape s : {MoeShape{5, 4, 2, 2880, 96}, MoeShape{3, 3, 2, 256, 1536}}) {
    check_all_kernels(to_fp8(make_moe_data(s, DType::bf16, Activation::swigluoai, true, 91), 128,
                             128));
    if (HasFailure()) return;
  }
  const Fp8Data f = to_fp8(make_moe_data({700, 3, 2, 64, 40}, DType::bf16, Activation::gelu, true,
                                         29), 128, 128);
  for (const cpumoe::F8GemmUkernel* kern : supported_f8_kernels()) {
    SCOPED_TRACE(kern->name);
    std::vector<uint8_t> first;
    for (int fuse : {2, 1, 0}) {
      cpumoe::MoeConfig<cpumoe::F8GemmUkernel> cfg = cpumoe::fp8_config(kern);
      cfg.tiles.fuse_gemm1 = fuse > 0;
      cfg.tiles.fuse_gemm2 = fuse > 1;
      cfg.tiles.rows = 200;
      const cpumoe::PackedMoeFp8 pk(weights_of(f), cfg, 1);
      for (int threads : {1, 3}) {
        std::vector<uint8_t> out = cpumoe_test::run_moe(pk, f.d, threads);
        if (first.empty()) first = out;
        ASSERT_TRUE(out == first) << "fuse=" << fuse << " threads=" << threads;
      }
    }
    cpumoe_test::expect_close(cpumoe_test::output_values(f.d, first),
                              cpumoe_ref::fused_moe_fp8(f.ref, f.d.ref_inputs()), kTol);
  }
}

// An expert map routes global ids to local experts; unmapped slots contribute nothing: the same
// as the local problem with those slots' weights set to 0.
TEST(MoeFp8, ExpertMap) {
  const Fp8Data f = to_fp8(make_moe_data({17, 4, 3, 64, 32}, DType::bf16, Activation::silu, false,
                                         5), 32, 32);
  std::vector<int32_t> map(8);
  for (int g = 0; g < 8; ++g) map[size_t(g)] = g % 2 == 0 ? g / 2 : -1;
  MoeData global = f.d, local = f.d;
  std::mt19937 rng(3);
  for (int64_t t = 0; t < f.d.s.T; ++t)
    for (int64_t j = 0; j < f.d.s.k; ++j) {
      const int g = int(rng() % 8);
      const size_t i = size_t(t * f.d.id_stride + j);
      global.ids[i] = g;
      local.ids[i] = g % 2 == 0 ? g / 2 : 0;
      if (g % 2) local.topk_w[size_t(t * f.d.w_stride + j)] = 0.0f;
    }
  for (const cpumoe::F8GemmUkernel* kern : supported_f8_kernels()) {
    SCOPED_TRACE(kern->name);
    const cpumoe::PackedMoeFp8 pk(weights_of(f), kern);
    EXPECT_TRUE(cpumoe_test::run_moe(pk, global, 2, true, map.data(), 8) ==
                cpumoe_test::run_moe(pk, local, 2));
  }
}

// W4A16's form: 4-bit codebook indices (code_bits 4) with (1, 32) block scales, against the
// same weights as E4M3 codes (the 8-bit twin, a negative scale's sign in its codes). Every kernel
// this CPU runs, those that keep 4-bit codes and those that get them widened.
struct Codes4Data {
  Fp8Data f;  // f.ref: the 8-bit twin
  std::vector<uint8_t> idx13, idx2;
  std::vector<float> s13, s2;  // as given to the 4-bit form (any sign)
  uint8_t codebook[16];
};

Codes4Data to_codes4(MoeData d, bool negative_scales, uint32_t seed) {
  Codes4Data c;
  for (int i = 0; i < 16; ++i) c.codebook[i] = e4m3_code(float(i - 8));  // int4: 0 at index 8
  std::mt19937 rng(seed);
  const auto& r = d.ref;
  Fp8Data& f = c.f;
  f.ref.E = r.E;
  f.ref.H = r.H;
  f.ref.I = r.I;
  f.ref.block_n = 1;
  f.ref.block_k = 32;
  const auto fill = [&](int64_t N, int64_t K, std::vector<uint8_t>* idx, std::vector<float>* sc,
                        std::vector<uint8_t>* twin, std::vector<float>* tsc) {
    const int64_t groups = (K + 31) / 32;
    for (int64_t e = 0; e < r.E; ++e)
      for (int64_t n = 0; n < N; ++n) {
        std::vector<float> s(static_cast<size_t>(groups));
        for (auto& v : s) {
          v = std::ldexp(1.0f + float(rng() % 64) / 64.0f, -7);
          if (negative_scales && rng() % 4 == 0) v = -v;
          sc->push_back(v);
          tsc->push_back(std::fabs(v));
        }
        for (int64_t k = 0; k < K; ++k) {
          const uint8_t i = uint8_t(rng() % 16);
          idx->push_back(i);
          twin->push_back(uint8_t(c.codebook[i] ^ (s[size_t(k / 32)] < 0.0f ? 0x80 : 0)));
        }
      }
  };
  fill(2 * r.I, r.H, &c.idx13, &c.s13, &f.ref.w13, &f.ref.s13);
  fill(r.H, r.I, &c.idx2, &c.s2, &f.ref.w2, &f.ref.s2);
  f.ref.b13 = r.b13;
  f.ref.b2 = r.b2;
  f.d = std::move(d);
  return c;
}

cpumoe::MoeWeightsFp8 weights_of(const Codes4Data& c) {
  cpumoe::MoeWeightsFp8 w = weights_of(c.f);
  w.code_bits = 4;
  w.codebook = c.codebook;
  w.w13 = c.idx13.data();
  w.w2 = c.idx2.data();
  w.s13 = c.s13.data();
  w.s2 = c.s2.data();
  return w;
}

TEST(MoeFp8, FourBitCodesGiveTheTwinsBits) {
  for (MoeShape s : {MoeShape{9, 6, 2, 96, 64}, MoeShape{40, 4, 2, 64, 200}}) {
    for (bool negative : {false, true}) {
      const Codes4Data c = to_codes4(
          make_moe_data(s, DType::bf16, Activation::silu, true, 17), negative, 23);
      SCOPED_TRACE(c.f.d.describe() + (negative ? " negative scales" : ""));
      for (const cpumoe::F8GemmUkernel* kern : supported_f8_kernels()) {
        SCOPED_TRACE(kern->name);
        const cpumoe::PackedMoeFp8 p4(weights_of(c), kern), p8(weights_of(c.f), kern);
        EXPECT_EQ(p4.code_bits(), kern->codes4 ? 4 : 8);
        EXPECT_EQ(p8.code_bits(), 8);
        if (kern->codes4) {
          EXPECT_LT(p4.packed_bytes(), p8.packed_bytes() * 6 / 10);
        }
        const std::vector<uint8_t> out = cpumoe_test::run_moe(p4, c.f.d, 2);
        if (!negative) {  // a negative scale flips the sign of some zero sums in the twin
          EXPECT_TRUE(out == cpumoe_test::run_moe(p8, c.f.d, 2)) << "not the 8-bit twin's bits";
        }
        cpumoe_test::expect_close(cpumoe_test::output_values(c.f.d, out),
                                  cpumoe_ref::fused_moe_fp8(c.f.ref, c.f.d.ref_inputs()), kTol);
      }
    }
  }
}

// 4-bit codes: an index above 15, a codebook without a zero or with a NaN code, a code_bits
// other than 4 or 8, or no codebook, each a clear error; a negative scale is one for 8-bit codes.
TEST(MoeFp8, FourBitCodesBadInput) {
  const Codes4Data c =
      to_codes4(make_moe_data({3, 4, 2, 64, 32}, DType::bf16, Activation::silu, false, 3), true, 5);
  const auto expect_error = [&](const cpumoe::MoeWeightsFp8& w, const std::string& part) {
    try {
      const cpumoe::PackedMoeFp8 p(w);
      ADD_FAILURE() << "no error, wanted one naming " << part;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  {
    std::vector<uint8_t> idx = c.idx13;
    idx[77] = 16;
    cpumoe::MoeWeightsFp8 w = weights_of(c);
    w.w13 = idx.data();
    expect_error(w, "above 15");
  }
  for (uint8_t bad : {uint8_t(0x7F), uint8_t(0xFF)}) {
    uint8_t book[16];
    std::copy(c.codebook, c.codebook + 16, book);
    book[3] = bad;
    cpumoe::MoeWeightsFp8 w = weights_of(c);
    w.codebook = book;
    expect_error(w, "is NaN");
  }
  {
    uint8_t book[16];
    std::copy(c.codebook, c.codebook + 16, book);
    book[8] = 0x38;
    cpumoe::MoeWeightsFp8 w = weights_of(c);
    w.codebook = book;
    expect_error(w, "needs a zero");
  }
  {
    cpumoe::MoeWeightsFp8 w = weights_of(c);
    w.codebook = nullptr;
    expect_error(w, "codebook: missing");
    w = weights_of(c);
    w.code_bits = 2;
    expect_error(w, "code_bits");
    w = weights_of(c.f);  // 8-bit codes with the 4-bit form's negative scales
    w.s13 = c.s13.data();
    expect_error(w, ">= 0");
  }
}

// The scratch bound of a kernel (any block shape) covers the packed layer's own.
TEST(MoeFp8, ScratchBoundsHold) {
  const Fp8Data f = to_fp8(make_moe_data({40, 8, 2, 256, 128}, DType::bf16, Activation::silu,
                                         true, 7), 128, 128);
  for (const cpumoe::F8GemmUkernel* kern : supported_f8_kernels()) {
    const cpumoe::PackedMoeFp8 pk(weights_of(f), kern);
    for (int64_t T : {1, 40, 5000})
      EXPECT_LE(cpumoe::fused_moe_scratch_bytes(pk, T, 2),
                cpumoe::fused_moe_scratch_bytes(*kern, 8, 256, 128, T, 2))
          << kern->name << " T=" << T;
  }
}

}  // namespace
