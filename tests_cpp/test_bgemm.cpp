// Every bgemm (bf16 -> fp32) microkernel in the registry against the naive double GEMM, plus the
// registry's own rules. Kernels the CPU cannot run are skipped.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "bgemm_tester.h"
#if defined(CPUMOE_TEST_AMX_TILE_MODEL)
#include "amx/amx_model_kernels.h"
#endif
#include "cpumoe/bgemm.h"
#include "cpumoe/cpu_features.h"
#include "cpumoe/dtype.h"

namespace {

using cpumoe::BGemmUkernel;
using cpumoe::Isa;
using cpumoe_test::BGemmTester;
using cpumoe_test::GuardedBuffer;

class BGemmKernelTest : public testing::TestWithParam<const BGemmUkernel*> {
 protected:
  void SetUp() override {
    if (!cpumoe::cpu_supports(kernel().isa))
      GTEST_SKIP() << kernel().name << " needs " << cpumoe::isa_name(kernel().isa)
                   << ", which this CPU lacks";
  }
  const BGemmUkernel& kernel() const { return *GetParam(); }
};

constexpr int64_t kMs[] = {1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33};
constexpr int64_t kNs[] = {1, 3, 4, 7, 8, 9, 15, 16, 17, 33, 48, 64, 65};
constexpr int64_t kKs[] = {1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 64, 72};

TEST_P(BGemmKernelTest, SmallShapesExact) {
  for (int64_t k : kKs)
    for (int64_t m : kMs)
      for (int64_t n : kNs) {
        BGemmTester().m(m).n(n).k(k).Test(kernel());
        if (HasFatalFailure()) return;
      }
}

TEST_P(BGemmKernelTest, RealValuesWithinTheFp32Bound) {
  for (int64_t k : {1, 9, 64, 768, 2048})
    for (int64_t m : {1, 2, 5, 8, 17})
      for (int64_t n : {1, 8, 33, 64}) {
        BGemmTester().m(m).n(n).k(k).reals().offsets(false).Test(kernel());
        if (HasFatalFailure()) return;
      }
}

TEST_P(BGemmKernelTest, DeepKExact) {
  struct Shape { int64_t m, n, k; };
  for (Shape s : {Shape{1, 1, 2880}, {7, 17, 2880}, {16, 64, 2880}, {1, 8, 4096}, {9, 33, 4096},
                  {3, 5, 16384}}) {
    BGemmTester().m(s.m).n(s.n).k(s.k).offsets(false).Test(kernel());
    if (HasFatalFailure()) return;
  }
}

TEST_P(BGemmKernelTest, StridesAndPadding) {
  struct Shape { int64_t m, n, k, row_pad, dst_pad; };
  for (Shape s : {Shape{5, 9, 17, 0, 0}, {8, 8, 8, 0, 0}, {17, 33, 72, 0, 1}, {9, 17, 16, 64, 17},
                  {33, 15, 9, 1, 64}, {16, 64, 64, 3, 0}}) {
    BGemmTester().m(s.m).n(s.n).k(s.k).row_padding(s.row_pad).dst_padding(s.dst_pad).Test(kernel());
    if (HasFatalFailure()) return;
  }
}

TEST_P(BGemmKernelTest, EmptyShapesWriteNothing) {
  const std::vector<float> ones(8, 1.0f);
  cpumoe_test::for_empty_shapes(kernel(), cpumoe::f32_to_bf16(1.0f),
                   [&](int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs) {
                     std::vector<float> f(64, 77.0f);
                     kernel().run_f32(m, n, k, lhs, rhs, f.data(), 8, ones.data());
                     for (float v : f) ASSERT_EQ(v, 77.0f);
                   });
}

// One-hot rows of A read packed B back: C[i][j] = B[j][i], for every bf16 bit pattern class that
// is a normal number (signs, large and small exponents).
TEST_P(BGemmKernelTest, PackRoundTripOneHot) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> e(-60, 60);
  std::uniform_int_distribution<int> mant(0, 127);
  for (int64_t k : {1, 3, 4, 5, 8, 9, 16, 17, 33}) {
    for (int64_t n : {1, 3, 8, 9, 17, 33}) {
      SCOPED_TRACE(testing::Message() << "k=" << k << " n=" << n);
      const int64_t ldb = k + 2;
      std::vector<uint16_t> b(size_t(n * ldb));
      for (auto& v : b)
        v = cpumoe::f32_to_bf16(std::ldexp(1.0f + float(mant(rng)) / 128.0f, e(rng)) *
                                (rng() % 2 ? -1.0f : 1.0f));
      std::vector<uint16_t> onehot(size_t(k * k), 0);
      std::vector<const uint16_t*> rows(static_cast<size_t>(k));
      for (int64_t i = 0; i < k; ++i) {
        onehot[size_t(i * k + i)] = cpumoe::f32_to_bf16(1.0f);
        rows[size_t(i)] = onehot.data() + i * k;
      }
      GuardedBuffer lhs(kernel().lhs_packed_size(k, k)), rhs(kernel().rhs_packed_size(n, k));
      kernel().pack_lhs(k, k, rows.data(), lhs.data());
      kernel().pack_rhs(n, k, b.data(), ldb, rhs.data());
      std::vector<float> c(size_t(k * n));
      kernel().run_f32(k, n, k, lhs.data(), rhs.data(), c.data(), n, nullptr);
      for (int64_t i = 0; i < k; ++i)
        for (int64_t j = 0; j < n; ++j)
          ASSERT_EQ(c[size_t(i * n + j)], cpumoe::bf16_to_f32(b[size_t(j * ldb + i)])) << i << " " << j;
    }
  }
}

// A NaN in a row of A makes that row's outputs NaN and leaves the other rows finite.
TEST_P(BGemmKernelTest, NaNStaysInItsRow) {
  const int64_t m = 9, n = 17, k = 40;
  std::vector<uint16_t> a(size_t(m * k), cpumoe::f32_to_bf16(0.5f)), b(size_t(n * k),
                                                                       cpumoe::f32_to_bf16(-2.0f));
  a[size_t(4 * k + 13)] = 0x7fc0;
  std::vector<const uint16_t*> rows(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) rows[size_t(i)] = a.data() + i * k;
  GuardedBuffer lhs(kernel().lhs_packed_size(m, k)), rhs(kernel().rhs_packed_size(n, k));
  kernel().pack_lhs(m, k, rows.data(), lhs.data());
  kernel().pack_rhs(n, k, b.data(), k, rhs.data());
  std::vector<float> c(size_t(m * n));
  kernel().run_f32(m, n, k, lhs.data(), rhs.data(), c.data(), n, nullptr);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      if (i == 4) {
        EXPECT_TRUE(std::isnan(c[size_t(i * n + j)])) << j;
      } else {
        EXPECT_EQ(c[size_t(i * n + j)], -40.0f) << i << " " << j;
      }
    }
}

// The dispatcher splits a GEMM into (row chunk, column tile) calls whose sizes depend on the
// thread count; the op is deterministic only if an output element is summed the same way in any
// such call. Every sub-block at tile offsets, and every row alone, must equal the full call bit
// for bit.
TEST_P(BGemmKernelTest, SubBlocksAreBitIdenticalToTheFullCall) {
  const BGemmUkernel& kn = kernel();
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t k : {37, 300, 2048}) {
    const int64_t m = 3 * kn.mr + 3, n = 4 * kn.nr + 5;
    SCOPED_TRACE(testing::Message() << "k=" << k);
    std::vector<uint16_t> a(size_t(m * k)), b(size_t(n * k));
    for (auto& v : a) v = cpumoe::f32_to_bf16(nd(rng));
    for (auto& v : b) v = cpumoe::f32_to_bf16(nd(rng));
    std::vector<const uint16_t*> rows(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) rows[size_t(i)] = a.data() + i * k;
    GuardedBuffer lhs(kn.lhs_packed_size(m, k)), rhs(kn.rhs_packed_size(n, k));
    kn.pack_lhs(m, k, rows.data(), lhs.data());
    kn.pack_rhs(n, k, b.data(), k, rhs.data());
    std::vector<float> full(size_t(m * n));
    kn.run_f32(m, n, k, lhs.data(), rhs.data(), full.data(), n, nullptr);
    for (int64_t m0 = 0; m0 < m; m0 += kn.mr)
      for (int64_t n0 = 0; n0 < n; n0 += kn.nr)
        for (int64_t mc : {int64_t(1), kn.mr, m - m0})
          for (int64_t nc : {int64_t(1), kn.nr, n - n0}) {
            const int64_t mm = std::min(mc, m - m0), nn = std::min(nc, n - n0);
            std::vector<float> part(size_t(mm * nn));
            kn.run_f32(mm, nn, k, lhs.data() + kn.lhs_packed_offset(m0, k),
                       rhs.data() + kn.rhs_packed_offset(n0, k), part.data(), nn, nullptr);
            for (int64_t i = 0; i < mm; ++i)
              for (int64_t j = 0; j < nn; ++j)
                ASSERT_EQ(std::memcmp(&part[size_t(i * nn + j)],
                                      &full[size_t((m0 + i) * n + n0 + j)], 4), 0)
                    << "block at (" << m0 << ", " << n0 << ") of " << mm << "x" << nn
                    << ", element (" << i << ", " << j << ")";
          }
  }
}

TEST_P(BGemmKernelTest, PackingInRowPiecesMatchesOneCall) {
  cpumoe_test::expect_lhs_packs_in_row_pieces<BGemmUkernel, uint16_t>(
      kernel(), [](size_t i) { return cpumoe::f32_to_bf16(float(int(i % 97) - 48) * 0.25f); });
}

TEST_P(BGemmKernelTest, PackedSizesAndOffsetsAreConsistent) {
  cpumoe_test::expect_packed_sizes_consistent(kernel(), 2);
}

std::string KernelName(const testing::TestParamInfo<const BGemmUkernel*>& info) {
  return info.param->name;
}

#if defined(CPUMOE_TEST_AMX_TILE_MODEL)
// The AMX kernels' code over the tile model (tests_cpp/amx), in a binary of its own.
INSTANTIATE_TEST_SUITE_P(AmxTileModel, BGemmKernelTest,
                         testing::Values(&cpumoe_test::bgemm_amx_tilemodel), KernelName);
#else
INSTANTIATE_TEST_SUITE_P(Registry, BGemmKernelTest, testing::ValuesIn(cpumoe::bgemm_registry()),
                         KernelName);
#endif

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

TEST(BGemmRegistry, BestFirstPortableLastNamesFollowTheGrammar) {
  const auto& reg = cpumoe::bgemm_registry();
  ASSERT_FALSE(reg.empty());
  EXPECT_EQ(reg.back()->isa, Isa::portable);
  const std::vector<Isa> ladder = cpumoe::isa_ladder();
  std::set<std::string> names;
  for (size_t i = 0; i < reg.size(); ++i) {
    const std::string name = reg[i]->name;
    EXPECT_TRUE(names.insert(name).second) << "duplicate " << name;
    EXPECT_EQ(name.rfind("bgemm_", 0), 0u) << name;
    EXPECT_TRUE(ends_with(name, std::string("_") + cpumoe::isa_name(reg[i]->isa))) << name;
    const std::string tile = "_" + std::to_string(reg[i]->mr) + "x" + std::to_string(reg[i]->nr) + "_";
    EXPECT_NE(name.find(tile), std::string::npos) << name << " lacks its tile " << tile;
    EXPECT_NE(std::find(ladder.begin(), ladder.end(), reg[i]->isa), ladder.end()) << name;
    EXPECT_EQ(cpumoe::bgemm_find(reg[i]->name), reg[i]);
    if (i + 1 < reg.size()) {
      EXPECT_GT(int(reg[i]->isa), int(reg[i + 1]->isa)) << name << " before " << reg[i + 1]->name;
    }
  }
  EXPECT_EQ(cpumoe::bgemm_find("bgemm_no_such_kernel"), nullptr);
}

TEST(BGemmRegistry, SelectIsTheBestSupportedWithinTheCap) {
  const Isa* env = cpumoe::env_isa_cap();
  for (Isa cap : cpumoe::isa_ladder()) {
    const BGemmUkernel* k = cpumoe::bgemm_select(&cap);
    ASSERT_NE(k, nullptr);
    const BGemmUkernel* want = nullptr;
    for (const BGemmUkernel* c : cpumoe::bgemm_registry())
      if (int(c->isa) <= int(cap) && (env == nullptr || int(c->isa) <= int(*env)) &&
          cpumoe::cpu_supports(c->isa)) {
        want = c;
        break;
      }
    EXPECT_EQ(k, want) << cpumoe::isa_name(cap);
  }
  const BGemmUkernel* sel = cpumoe::bgemm_select();
  std::cout << "[ selected ] " << sel->name << " (isa " << cpumoe::isa_name(sel->isa) << ")"
            << std::endl;
}

}  // namespace
