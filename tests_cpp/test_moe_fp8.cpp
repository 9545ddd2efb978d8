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

// The nearest E4M3 code of v (ties: the even code; |v| > 448 saturates), by search over the 127
// non-negative finite codes (their values increase with the code).
uint8_t e4m3_code(float v) {
  const float a = std::fabs(v);
  uint8_t lo = 0, hi = 0x7E;
  while (lo < hi) {  // the first code whose value is >= a
    const uint8_t mid = uint8_t((lo + hi) / 2);
    if (cpumoe_ref::e4m3(mid) < a) lo = uint8_t(mid + 1); else hi = mid;
  }
  uint8_t c = lo;
  if (c > 0) {
    const float below = cpumoe_ref::e4m3(uint8_t(c - 1)), above = cpumoe_ref::e4m3(c);
    if (a - below < above - a || (a - below == above - a && (c - 1) % 2 == 0)) c = uint8_t(c - 1);
  }
  return uint8_t(c | (std::signbit(v) ? 0x80 : 0));
}

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
