// The BF16 op (PackedMoeBf16 + fused_moe_bf16) against the naive oracle, for every bgemm kernel
// this CPU runs: a grid of shapes, activations, dtypes and routings; determinism across thread
// counts; expert map; NaN rows; argument errors. The problems are those of the int8 tests with
// the weights dequantized to bf16 (same magnitudes, every activation region reached).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "cpumoe/moe.h"
#include "moe_test_util.h"
#include "reference/reference.h"

namespace {

using cpumoe::Activation;
using cpumoe::ArgumentError;
using cpumoe::DType;
using cpumoe_test::make_moe_data;
using cpumoe_test::MoeData;
using cpumoe_test::MoeShape;

// The kernels sum in fp32 (in their own order), the oracle in double: GEMM outputs differ by a
// few fp32 ulps, which can flip the bf16 rounding of one activation element (0.4% of it, times
// one weight). Outputs are O(1) with >= 8 terms; 1e-2 of max|ref| plus 1e-2 relative (bf16 output
// rounding) still fails any wrong routing, layout, weight or bias.
constexpr double kTol = 1e-2;

struct Bf16Data {
  MoeData d;
  cpumoe_ref::MoeProblemBf16 ref;
};

// The int8 problem's weights as bf16 values: w * channel scale, rounded.
Bf16Data to_bf16(MoeData d) {
  Bf16Data b;
  const auto& r = d.ref;
  b.ref.E = r.E;
  b.ref.H = r.H;
  b.ref.I = r.I;
  b.ref.w13.resize(r.w13.size());
  b.ref.w2.resize(r.w2.size());
  for (size_t i = 0; i < r.w13.size(); ++i)
    b.ref.w13[i] = cpumoe::f32_to_bf16(float(r.w13[i]) * r.s13[i / size_t(r.H)]);
  for (size_t i = 0; i < r.w2.size(); ++i)
    b.ref.w2[i] = cpumoe::f32_to_bf16(float(r.w2[i]) * r.s2[i / size_t(r.I)]);
  b.ref.b13 = r.b13;
  b.ref.b2 = r.b2;
  b.d = std::move(d);
  return b;
}

cpumoe::MoeWeightsBf16 weights_of(const Bf16Data& b) {
  auto w = b.d.sized_weights<cpumoe::MoeWeightsBf16>();
  w.w13 = b.ref.w13.data();
  w.w2 = b.ref.w2.data();
  return w;
}

std::vector<uint8_t> run(const cpumoe::PackedMoeBf16& pk, const MoeData& d, int threads,
                         const int32_t* expert_map = nullptr, int64_t num_global = 0) {
  return cpumoe_test::run_moe(pk, d, threads, true, expert_map, num_global);
}

std::vector<const cpumoe::BGemmUkernel*> supported_bf16_kernels() {
  return cpumoe_test::supported_kernels(cpumoe::bgemm_registry());
}

double g_worst = 0.0;

void check_all_kernels(const Bf16Data& b) {
  const MoeData& d = b.d;
  SCOPED_TRACE(d.describe());
  const std::vector<float> want = cpumoe_ref::fused_moe_bf16(b.ref, d.ref_inputs());
  g_worst = std::max(g_worst, cpumoe_test::check_kernels<cpumoe::PackedMoeBf16>(
                                  supported_bf16_kernels(), weights_of(b), d, want, kTol));
}

// Phases 4-5 (and 6) fused into row tasks (MoeTilePolicy::fuse_gemm1, fuse_gemm2) and phase by
// phase give the same bits on every kernel (experts of several row chunks, a partial last
// chunk, 1 and 3 threads), within the oracle's tolerance.
TEST(MoeBf16Fusion, FusedAndPhasedGiveTheSameBits) {
  const Bf16Data b = to_bf16(cpumoe_test::make_moe_data({700, 3, 2, 64, 40}, DType::bf16,
                                                         Activation::gelu, true, 29));
  const MoeData& d = b.d;
  const std::vector<float> want = cpumoe_ref::fused_moe_bf16(b.ref, d.ref_inputs());
  for (const cpumoe::BGemmUkernel* kern : supported_bf16_kernels()) {
    SCOPED_TRACE(kern->name);
    std::vector<uint8_t> first;
    for (int fuse : {2, 1, 0}) {
      cpumoe::MoeConfig<cpumoe::BGemmUkernel> cfg = cpumoe::bf16_config(kern);
      cfg.tiles.fuse_gemm1 = fuse > 0;
      cfg.tiles.fuse_gemm2 = fuse > 1;
      cfg.tiles.rows = 200;
      const cpumoe::PackedMoeBf16 pk(weights_of(b), cfg, 1);
      for (int threads : {1, 3}) {
        SCOPED_TRACE(testing::Message() << "fuse=" << fuse << " threads=" << threads);
        std::vector<uint8_t> out = run(pk, d, threads);
        if (first.empty()) first = out;
        ASSERT_TRUE(out == first);
      }
    }
    cpumoe_test::expect_close(cpumoe_test::output_values(d, first), want, kTol);
  }
}

class MoeBf16GridTest : public testing::TestWithParam<cpumoe_test::GridParam> {};

TEST_P(MoeBf16GridTest, MatchesOracle) {
  cpumoe_test::bf16_op_grid(GetParam(), 7000, "bf16", supported_bf16_kernels().size(), g_worst,
                            [](MoeData d, uint32_t) { check_all_kernels(to_bf16(std::move(d))); });
}

INSTANTIATE_TEST_SUITE_P(All, MoeBf16GridTest, cpumoe_test::grid_params(),
                         cpumoe_test::grid_name);

// Real layer widths (K up to 2880) and a batch that spans more than one 16384-slot chunk.
TEST(MoeBf16, WideLayersAndManyTokens) {
  for (MoeShape s : {MoeShape{5, 4, 2, 2880, 96}, MoeShape{3, 3, 2, 256, 1536},
                     MoeShape{4200, 8, 4, 16, 8}}) {
    check_all_kernels(to_bf16(make_moe_data(s, DType::bf16, Activation::swigluoai, true, 91)));
    if (HasFailure()) return;
  }
}

// An expert map routes global ids to local experts; unmapped slots contribute nothing. Same as
// running the local experts with the unmapped slots' weights set to 0.
TEST(MoeBf16, ExpertMap) {
  Bf16Data b = to_bf16(make_moe_data({17, 4, 3, 64, 32}, DType::bf16, Activation::silu, false, 5));
  // Global experts 0..7: local e = g / 2 for even g, odd g elsewhere.
  std::vector<int32_t> map(8);
  for (int g = 0; g < 8; ++g) map[size_t(g)] = g % 2 == 0 ? g / 2 : -1;
  MoeData global = b.d;
  MoeData local = b.d;
  std::mt19937 rng(3);
  for (int64_t t = 0; t < b.d.s.T; ++t)
    for (int64_t j = 0; j < b.d.s.k; ++j) {
      const int g = int(rng() % 8);
      const size_t i = size_t(t * b.d.id_stride + j);
      global.ids[i] = g;
      local.ids[i] = g % 2 == 0 ? g / 2 : 0;
      if (g % 2) local.topk_w[size_t(t * b.d.w_stride + j)] = 0.0f;
    }
  for (const cpumoe::BGemmUkernel* kern : supported_bf16_kernels()) {
    const cpumoe::PackedMoeBf16 pk(weights_of(b), kern);
    const std::vector<float> got = cpumoe_test::output_values(global, run(pk, global, 2, map.data(), 8));
    const std::vector<float> want = cpumoe_test::output_values(local, run(pk, local, 2));
    cpumoe_test::expect_close(got, want, 1e-6);
  }
}

TEST(MoeBf16, NaNTokenGivesANaNRowOnly) {
  Bf16Data b = to_bf16(make_moe_data({6, 4, 2, 32, 16}, DType::f32, Activation::gelu, true, 8));
  b.d.set_x(2, 5, std::nanf(""));
  for (const cpumoe::BGemmUkernel* kern : supported_bf16_kernels()) {
    const cpumoe::PackedMoeBf16 pk(weights_of(b), kern);
    const std::vector<float> got = cpumoe_test::output_values(b.d, run(pk, b.d, 1));
    for (int64_t t = 0; t < b.d.s.T; ++t)
      for (int64_t c = 0; c < b.d.s.H; ++c)
        ASSERT_EQ(std::isnan(got[size_t(t * b.d.s.H + c)]), t == 2) << kern->name << " " << t;
  }
}

TEST(MoeBf16, PackedAccessorsAndScratch) {
  Bf16Data b = to_bf16(make_moe_data({1, 3, 1, 16, 8}, DType::bf16, Activation::silu, true, 2));
  const cpumoe::PackedMoeBf16 pk(weights_of(b));
  EXPECT_EQ(pk.num_experts(), 3);
  EXPECT_EQ(pk.hidden(), 16);
  EXPECT_EQ(pk.intermediate(), 8);
  EXPECT_TRUE(pk.has_bias13());
  EXPECT_EQ(&pk.kernel(), cpumoe::bgemm_select());
  // bf16 weights (2 bytes each) plus fp32 biases at least.
  EXPECT_GE(pk.packed_bytes(), size_t(3 * 3 * 16 * 8 * 2 + 3 * (16 + 16) * 4));
  EXPECT_EQ(cpumoe::fused_moe_scratch_bytes(pk, 0, 2), 0u);
  EXPECT_GT(cpumoe::fused_moe_scratch_bytes(pk, 5, 2), 0u);
  cpumoe::release_thread_scratch();
  (void)run(pk, b.d, 1);
  EXPECT_GT(cpumoe::thread_scratch_bytes(), 0u);
  EXPECT_LE(cpumoe::thread_scratch_bytes(), cpumoe::fused_moe_scratch_bytes(pk, 1, 1, 1));
}

TEST(MoeBf16, ArgumentErrors) {
  Bf16Data b = to_bf16(make_moe_data({3, 4, 2, 16, 8}, DType::bf16, Activation::silu, false, 4));
  cpumoe::MoeWeightsBf16 w = weights_of(b);
  w.hidden = 12;
  EXPECT_THROW(cpumoe::PackedMoeBf16 p(w), ArgumentError);
  w = weights_of(b);
  w.w2 = nullptr;
  EXPECT_THROW(cpumoe::PackedMoeBf16 p(w), ArgumentError);
  const cpumoe::PackedMoeBf16 pk(weights_of(b));
  MoeData d = b.d;
  d.ids[0] = 4;  // outside [0, E)
  try {
    (void)run(pk, d, 1);
    ADD_FAILURE() << "an expert id outside [0, E) was accepted";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("topk_ids", 0), 0u) << e.what();
  }
  std::vector<uint8_t> out(size_t(d.s.T * d.out_stride * d.es()));
  cpumoe::MoeCall c = cpumoe_test::make_call(b.d, out.data(), b.d.ids.data(), true, 1);
  c.out = const_cast<uint8_t*>(b.d.x.data());
  EXPECT_THROW(cpumoe::fused_moe_bf16(pk, c), ArgumentError);
}

}  // namespace
