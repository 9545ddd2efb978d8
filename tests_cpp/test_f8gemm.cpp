// Every f8gemm (W8A16 FP8: bf16 x E4M3 with fp32 block scales) microkernel in the registry
// against the naive oracle: within the fp32 bound of a group sum, bit for bit where the sums are
// exact, and bit for bit between a whole call and calls at tile offsets; plus the registry's own
// rules and the E4M3 decoding. Kernels the CPU cannot run are skipped.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cpumoe/cpu_features.h"
#include "cpumoe/dtype.h"
#include "cpumoe/f8gemm.h"
#include "f8gemm_tester.h"
#if defined(CPUMOE_TEST_AMX_TILE_MODEL)
#include "amx/amx_model_kernels.h"
#endif
#include "reference/reference.h"

namespace {

using cpumoe::F8GemmUkernel;
using cpumoe::F8Layout;
using cpumoe::Isa;
using cpumoe_test::F8GemmTester;
using cpumoe_test::GuardedBuffer;

class F8GemmKernelTest : public testing::TestWithParam<const F8GemmUkernel*> {
 protected:
  void SetUp() override {
    if (!cpumoe::cpu_supports(kernel().isa))
      GTEST_SKIP() << kernel().name << " needs " << cpumoe::isa_name(kernel().isa)
                   << ", which this CPU lacks";
  }
  const F8GemmUkernel& kernel() const { return *GetParam(); }

  // m: none, one, below, at and above the register tile, and two tiles and a tail.
  std::vector<int64_t> ms() const {
    const int64_t mr = kernel().mr;
    return unique({0, 1, 2, mr - 1, mr, mr + 1, 2 * mr + 3});
  }
  // n: none, one, below, at and above a packed block, and two blocks and a tail.
  std::vector<int64_t> ns() const {
    const int64_t nr = kernel().nr;
    return unique({0, 1, nr - 1, nr, nr + 1, 2 * nr + 5});
  }
  static std::vector<int64_t> unique(std::vector<int64_t> v) {
    v.erase(std::remove_if(v.begin(), v.end(), [](int64_t x) { return x < 0; }), v.end());
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return v;
  }
};

// k: below, at and above a group of 32 and of 128, and 392 = 3 * 128 + 8 (a short last group).
constexpr int64_t kKs[] = {8, 32, 40, 128, 136, 256, 384 + 8};
// A group of 32 (the smallest), 128 (the usual 128 x 128 blocks), and 4096 >= k (one group).
constexpr int64_t kGroups[] = {32, 128, 4096};

bool valid_group(int64_t group, int64_t k) {
  return group >= k || group % cpumoe::kF8GroupMultiple == 0;
}

// Every tail of m and n against every depth and group class, with a scale per column, per 3
// columns (blocks across packed blocks), per 128 columns and one for all n.
TEST_P(F8GemmKernelTest, SystematicTails) {
  for (int64_t k : kKs)
    for (int64_t group : kGroups) {
      if (!valid_group(group, k)) continue;
      for (int64_t m : ms())
        for (int64_t n : ns())
          for (int64_t bn : {int64_t(1), int64_t(3), int64_t(128), std::max<int64_t>(n, 1)}) {
            F8GemmTester().m(m).n(n).k(k).group(group).block_n(bn).Test(kernel());
            if (HasFatalFailure()) return;
          }
    }
}

// Exact group sums: the oracle's bits, whatever order the kernel sums in, so the epilogue's
// order (groups in increasing order from 0, scale then accumulate, bias last) is checked exactly.
TEST_P(F8GemmKernelTest, ExactSumsMatchTheOracleBitForBit) {
  const int64_t mr = kernel().mr, nr = kernel().nr;
  for (int64_t k : kKs)
    for (int64_t group : kGroups)
      for (int64_t m : {int64_t(1), mr + 1, 2 * mr + 3})
        for (int64_t n : {int64_t(1), nr + 1, 2 * nr + 5})
          for (int64_t bn : {int64_t(1), int64_t(3), n}) {
            F8GemmTester().m(m).n(n).k(k).group(group).block_n(bn).exact(true).Test(kernel());
            if (HasFatalFailure()) return;
          }
}

// Depths that are no multiple of 8 or of the group: the last group's padding to kr (zero codes,
// zero A) and groups of one k.
TEST_P(F8GemmKernelTest, OddDepthsAndPartialGroups) {
  const int64_t mr = kernel().mr, nr = kernel().nr;
  for (int64_t k : {1, 2, 3, 5, 17, 31, 33, 63, 65, 100, 129, 161, 200})
    for (int64_t group : {32, 64, 96, 4096})
      for (bool exact : {false, true})
        for (int64_t m : {int64_t(1), mr + 1})
          for (int64_t n : {nr - 1, 2 * nr + 5}) {
            if (n < 1) continue;
            F8GemmTester().m(m).n(n).k(k).group(group).block_n(3).exact(exact).Test(kernel());
            if (HasFatalFailure()) return;
          }
}

// Real depths: DeepSeek-V3's 7168 and 2048 with 128 x 128 blocks, gpt-oss's 2880 (a last group
// of 64), per-channel scales over K = 4096, and groups longer than a kernel's k piece.
TEST_P(F8GemmKernelTest, DeepK) {
  struct Shape { int64_t m, n, k, group, block_n; };
  for (Shape s : {Shape{1, 64, 7168, 128, 128}, {9, 33, 2048, 128, 128}, {5, 17, 2880, 128, 128},
                  {3, 40, 4096, 4096, 1}, {2, 9, 16384, 16384, 3}, {17, 24, 1024, 512, 16}}) {
    F8GemmTester().m(s.m).n(s.n).k(s.k).group(s.group).block_n(s.block_n).offsets(s.k <= 2880)
        .Test(kernel());
    if (HasFatalFailure()) return;
  }
  // Groups of 4096 are the longest exact() allows.
  F8GemmTester().m(5).n(11).k(8192).group(4096).block_n(1).exact(true).offsets(false)
      .Test(kernel());
}

// Scales of 1e-30, 1e30, -1e30 and 0 in some blocks.
TEST_P(F8GemmKernelTest, ExtremeScales) {
  for (int64_t group : kGroups)
    for (int64_t m : {int64_t(1), kernel().mr + 1, int64_t(17)})
      for (int64_t n : {int64_t(5), kernel().nr + 1, int64_t(33)})
        for (bool exact : {false, true}) {
          F8GemmTester().m(m).n(n).k(392).group(group).block_n(3).extreme_scales(true)
              .exact(exact).Test(kernel());
          if (HasFatalFailure()) return;
        }
}

// 4-bit codes (W4A16: indices into a 16-code codebook, F8Layout::code_bits 4) on the kernels
// that take them: every tail, depth and group class, real and exact sums, and the same bits as
// the same weights packed as 8-bit codes (the tester checks it). Kernels without them skip.
TEST_P(F8GemmKernelTest, FourBitCodes) {
  if (!kernel().codes4) GTEST_SKIP() << kernel().name << " takes 8-bit codes only";
  for (int64_t k : {1, 17, 40, 128, 136, 392, 2880})
    for (int64_t group : kGroups) {
      if (!valid_group(group, k)) continue;
      for (int64_t m : ms())
        for (int64_t n : ns())
          for (bool exact : {false, true}) {
            if (exact && group > 4096) continue;
            F8GemmTester().m(m).n(n).k(k).group(group).block_n(n % 2 ? 1 : 3).exact(exact)
                .codes4(true).offsets(k <= 392).Test(kernel());
            if (HasFatalFailure()) return;
          }
    }
}

// The portable kernel, the floor of every chain, takes 4-bit codes, so a layer packed with
// them runs on every CPU.
TEST(F8GemmRegistry, PortableTakesFourBitCodes) {
  EXPECT_TRUE(cpumoe::f8gemm_registry().back()->codes4);
}

// One-hot rows of A (bf16 1.0) read every code back through the kernel's decoding: C[i][j] =
// e4m3(B[j][i]) * s exactly (one non-zero product per output), for all 254 non-NaN codes.
TEST_P(F8GemmKernelTest, DecodesEveryCode) {
  const std::vector<uint8_t> all = cpumoe_test::e4m3_codes(false);
  const int64_t k = int64_t(all.size()), n = 3;
  std::vector<uint8_t> codes(size_t(n * k));
  for (int64_t x = 0; x < k; ++x) {
    codes[size_t(x)] = all[size_t(x)];
    codes[size_t(k + x)] = all[size_t(k - 1 - x)];
    codes[size_t(2 * k + x)] = all[size_t((x * 37) % k)];
  }
  std::vector<uint16_t> onehot(size_t(k * k), 0);
  std::vector<const uint16_t*> rows(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) {
    onehot[size_t(i * k + i)] = cpumoe::f32_to_bf16(1.0f);
    rows[size_t(i)] = onehot.data() + i * k;
  }
  for (const F8Layout w : {F8Layout{4096, 1}, F8Layout{32, 2}}) {
    SCOPED_TRACE(testing::Message() << "group=" << w.group << " block_n=" << w.block_n);
    const int64_t groups = cpumoe::f8_groups(k, w), scale_rows = (n + w.block_n - 1) / w.block_n;
    std::vector<float> scales(size_t(scale_rows * groups), 1.0f);
    for (int64_t g = 0; g < groups; ++g)  // column 2's block
      scales[size_t(2 / w.block_n * groups + g)] = 0.5f;
    const F8GemmUkernel& kn = kernel();
    GuardedBuffer lhs(kn.lhs_packed_size(k, k)), rhs(kn.rhs_packed_size(n, k, w));
    kn.pack_lhs(k, k, rows.data(), lhs.data());
    kn.pack_rhs(n, k, w, codes.data(), k, scales.data(), groups, rhs.data());
    const size_t sb = kn.scratch_bytes(k, n, k, w);
    GuardedBuffer scratch(sb);
    cpumoe::F8GemmEpilogue ep;
    ep.scratch = sb > 0 ? scratch.data() : nullptr;
    std::vector<float> c(size_t(k * n));
    kn.run_f32(k, n, k, w, lhs.data(), rhs.data(), c.data(), n, ep);
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = 0; j < n; ++j) {
        const uint8_t code = codes[size_t(j * k + i)];
        const float want = cpumoe_ref::e4m3(code) * (j == 2 ? 0.5f : 1.0f);
        ASSERT_EQ(c[size_t(i * n + j)], want)
            << "code 0x" << std::hex << int(code) << std::dec << " at [" << i << "][" << j << "]";
      }
  }
}

// A NaN in a row of A makes that row's outputs NaN (whatever the code and scale it meets) and
// leaves the other rows finite.
TEST_P(F8GemmKernelTest, NaNStaysInItsRow) {
  const int64_t m = 9, n = 17, k = 72;
  const F8Layout w{32, 3};
  std::vector<uint16_t> a(size_t(m * k), cpumoe::f32_to_bf16(0.5f));
  a[size_t(4 * k + 13)] = 0x7fc0;
  std::vector<uint8_t> codes(size_t(n * k), 0x38);  // 1.0
  for (int64_t j = 0; j < n; ++j) codes[size_t(j * k + 13)] = 0x00;  // NaN * 0 is NaN too
  std::vector<float> scales(size_t(((n + 2) / 3) * 3), 2.0f);
  scales[0] = 0.0f;
  std::vector<const uint16_t*> rows(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) rows[size_t(i)] = a.data() + i * k;
  const F8GemmUkernel& kn = kernel();
  GuardedBuffer lhs(kn.lhs_packed_size(m, k)), rhs(kn.rhs_packed_size(n, k, w));
  kn.pack_lhs(m, k, rows.data(), lhs.data());
  kn.pack_rhs(n, k, w, codes.data(), k, scales.data(), 3, rhs.data());
  GuardedBuffer scratch(kn.scratch_bytes(m, n, k, w));
  cpumoe::F8GemmEpilogue ep;
  ep.scratch = scratch.data();
  std::vector<float> c(size_t(m * n));
  kn.run_f32(m, n, k, w, lhs.data(), rhs.data(), c.data(), n, ep);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float v = c[size_t(i * n + j)];
      if (i == 4) {
        EXPECT_TRUE(std::isnan(v)) << j;
      } else {
        // Groups of 32, 32 and 8 k sum 15.5 (code 0 at k 13), 16 and 4, each scaled by 2 but
        // the first group of columns 0-2 (scale 0).
        EXPECT_EQ(v, j < 3 ? 40.0f : 71.0f) << i << " " << j;
      }
    }
}

// Packing writes every byte of the packed size and reads nothing but the codes and scales it is
// given: the result depends neither on what the buffer held before, nor on the rows' padding.
TEST_P(F8GemmKernelTest, PackingIsFullyDetermined) {
  std::mt19937 rng(5);
  const std::vector<uint8_t> all = cpumoe_test::e4m3_codes(false);
  for (const F8Layout w : {F8Layout{32, 1}, F8Layout{128, 3}, F8Layout{4096, 128}}) {
    for (int64_t k : {1, 17, 40, 136}) {
      for (int64_t n : {1, 3, 9, 17, 40}) {
        SCOPED_TRACE(testing::Message() << "group=" << w.group << " block_n=" << w.block_n
                                        << " k=" << k << " n=" << n);
        const int64_t groups = cpumoe::f8_groups(k, w), ldc = k + 7, lds = groups + 3;
        const int64_t rows = (n + w.block_n - 1) / w.block_n;
        std::vector<uint8_t> codes(size_t(n * ldc));
        std::vector<float> sc(size_t(rows * lds));
        for (auto& v : codes) v = all[rng() % all.size()];
        for (auto& v : sc) v = float(rng() % 1000) / 64.0f;
        std::vector<uint8_t> codes2 = codes;
        std::vector<float> sc2 = sc;
        for (int64_t j = 0; j < n; ++j)
          for (int64_t x = k; x < ldc; ++x) codes2[size_t(j * ldc + x)] = uint8_t(rng());
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t g = groups; g < lds; ++g) sc2[size_t(r * lds + g)] = -1e30f;
        const size_t rs = kernel().rhs_packed_size(n, k, w);
        std::vector<uint8_t> r0(rs, 0x00), r1(rs, 0xff);
        kernel().pack_rhs(n, k, w, codes.data(), ldc, sc.data(), lds, r0.data());
        kernel().pack_rhs(n, k, w, codes2.data(), ldc, sc2.data(), lds, r1.data());
        ASSERT_EQ(r0, r1) << "pack_rhs left bytes unwritten or read past the codes or scales";
        if (!kernel().codes4) continue;
        // 4-bit codes: the indices (codes & 15), the padding's zero at index 5.
        F8Layout w4 = w;
        w4.code_bits = 4;
        for (int i = 0; i < 16; ++i) w4.codebook[size_t(i)] = all[size_t(i * 11)];
        w4.codebook[5] = 0x80;
        for (auto* c : {&codes, &codes2})
          for (int64_t j = 0; j < n; ++j)
            for (int64_t x = 0; x < k; ++x) (*c)[size_t(j * ldc + x)] &= 15;
        const size_t rs4 = kernel().rhs_packed_size(n, k, w4);
        std::vector<uint8_t> q0(rs4, 0x00), q1(rs4, 0xff);
        kernel().pack_rhs(n, k, w4, codes.data(), ldc, sc.data(), lds, q0.data());
        kernel().pack_rhs(n, k, w4, codes2.data(), ldc, sc2.data(), lds, q1.data());
        ASSERT_EQ(q0, q1) << "4-bit pack_rhs left bytes unwritten or read past the codes";
      }
    }
  }
}

// The packed sizes and offsets are consistent, and the packed weights are what the format is
// for: a byte per weight plus the block scales (per column and group), with at most a 64-byte
// pad per group and block.
TEST_P(F8GemmKernelTest, PackedSizesAndOffsetsAreConsistent) {
  const F8GemmUkernel& kn = kernel();
  EXPECT_GE(kn.mr, 1);
  EXPECT_GE(kn.nr, 1);
  EXPECT_GE(kn.kr, 1);
  EXPECT_EQ(cpumoe::kF8GroupMultiple % kn.kr, 0) << "kr must divide kF8GroupMultiple";
  for (const F8Layout w : {F8Layout{32, 1}, F8Layout{128, 128}, F8Layout{1 << 20, 7}}) {
    for (int64_t k : {1, 7, 8, 33, 136, 2880}) {
      const int64_t kp = cpumoe::round_up(k, kn.kr), groups = cpumoe::f8_groups(k, w);
      for (int64_t m = 0; m <= 40; ++m) {
        SCOPED_TRACE(testing::Message() << "group=" << w.group << " k=" << k << " m=n=" << m);
        const size_t ls = kn.lhs_packed_size(m, k), rs = kn.rhs_packed_size(m, k, w);
        ASSERT_GE(ls, size_t(m * kp) * 2);
        ASSERT_GE(rs, size_t(m * (kp + 4 * groups)));
        const int64_t blocks = (m + kn.nr - 1) / kn.nr;
        ASSERT_LE(rs, size_t(blocks * (kn.nr * (kp + 4 * groups) + 64 * (groups + 1))));
        ASSERT_GE(kn.lhs_packed_size(m + 1, k), ls);
        ASSERT_GE(kn.rhs_packed_size(m + 1, k, w), rs);
        ASSERT_EQ(kn.lhs_packed_offset(0, k), 0u);
        ASSERT_EQ(kn.rhs_packed_offset(0, k, w), 0u);
        for (int64_t i = kn.mr; i < m; i += kn.mr)
          ASSERT_LE(kn.lhs_packed_offset(i, k) + kn.lhs_packed_size(m - i, k), ls) << i;
        for (int64_t j = kn.nr; j < m; j += kn.nr) {
          ASSERT_LE(kn.rhs_packed_offset(j, k, w) + kn.rhs_packed_size(m - j, k, w), rs) << j;
          ASSERT_EQ(kn.rhs_packed_offset(j, k, w) % 64, 0u) << j;
        }
      }
    }
  }
}

TEST_P(F8GemmKernelTest, PackingInRowPiecesMatchesOneCall) {
  cpumoe_test::expect_lhs_packs_in_row_pieces<F8GemmUkernel, uint16_t>(
      kernel(), [](size_t i) { return cpumoe::f32_to_bf16(float(int(i % 97) - 48) * 0.25f); });
}

TEST_P(F8GemmKernelTest, EmptyShapesWriteNothing) {
  const F8Layout w{32, 1};
  const int64_t k = 64;
  const F8GemmUkernel& kn = kernel();
  std::vector<uint16_t> a(size_t(8 * k), cpumoe::f32_to_bf16(1.0f));
  std::vector<const uint16_t*> rows(8, a.data());
  std::vector<uint8_t> codes(size_t(8 * k), 0x38);
  std::vector<float> sc(16, 1.0f);
  GuardedBuffer lhs(kn.lhs_packed_size(8, k)), rhs(kn.rhs_packed_size(8, k, w));
  kn.pack_lhs(8, k, rows.data(), lhs.data());
  kn.pack_rhs(8, k, w, codes.data(), k, sc.data(), 2, rhs.data());
  for (auto [m, n] : {std::pair<int64_t, int64_t>{0, 8}, {8, 0}, {0, 0}}) {
    ASSERT_EQ(kn.scratch_bytes(m, n, k, w), 0u) << "m=" << m << " n=" << n;
    std::vector<float> dst(64, -1.0f);
    kn.run_f32(m, n, k, w, lhs.data(), rhs.data(), dst.data(), 8, cpumoe::F8GemmEpilogue{});
    for (float v : dst) ASSERT_EQ(v, -1.0f) << "m=" << m << " n=" << n;
  }
}

// The dispatcher reserves scratch_bytes once at the largest shape it calls, so it must not
// shrink as m or n grow; and it stays a small multiple of the call's own data.
TEST_P(F8GemmKernelTest, ScratchBytesIsMonotoneAndBounded) {
  for (const F8Layout w : {F8Layout{32, 1}, F8Layout{128, 128}, F8Layout{4096, 1}}) {
    for (int64_t k : {int64_t(1), int64_t(40), w.group, 4 * w.group}) {
      for (int64_t m = 0; m <= 70; ++m) {
        for (int64_t n : {int64_t(0), int64_t(1), int64_t(31), int64_t(33), int64_t(1536)}) {
          SCOPED_TRACE(testing::Message() << "group=" << w.group << " k=" << k << " m=" << m
                                          << " n=" << n);
          const size_t b = kernel().scratch_bytes(m, n, k, w);
          ASSERT_LE(b, kernel().scratch_bytes(m + 1, n, k, w));
          ASSERT_LE(b, kernel().scratch_bytes(m, n + 1, k, w));
          ASSERT_LE(b, size_t(64 * (m + 8) * (k + 64) + 64)) << "beyond the call's size";
        }
      }
    }
  }
}

std::string KernelName(const testing::TestParamInfo<const F8GemmUkernel*>& info) {
  return info.param->name;
}

#if defined(CPUMOE_TEST_AMX_TILE_MODEL)
// The AMX kernel's code over the tile model (tests_cpp/amx), in a binary of its own.
INSTANTIATE_TEST_SUITE_P(AmxTileModel, F8GemmKernelTest,
                         testing::Values(&cpumoe_test::f8gemm_amx_tilemodel), KernelName);
#else
INSTANTIATE_TEST_SUITE_P(Registry, F8GemmKernelTest, testing::ValuesIn(cpumoe::f8gemm_registry()),
                         KernelName);
#endif

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

TEST(F8GemmRegistry, BestFirstPortableLastNamesFollowTheGrammar) {
  const auto& reg = cpumoe::f8gemm_registry();
  ASSERT_FALSE(reg.empty());
  EXPECT_EQ(reg.back()->isa, Isa::portable);
  const std::vector<Isa> ladder = cpumoe::isa_ladder();
  std::set<std::string> names;
  for (size_t i = 0; i < reg.size(); ++i) {
    const std::string name = reg[i]->name;
    EXPECT_TRUE(names.insert(name).second) << "duplicate " << name;
    EXPECT_EQ(name.rfind("f8gemm_", 0), 0u) << name;
    EXPECT_TRUE(ends_with(name, std::string("_") + cpumoe::isa_name(reg[i]->isa))) << name;
    const std::string tile =
        "_" + std::to_string(reg[i]->mr) + "x" + std::to_string(reg[i]->nr) + "_";
    EXPECT_NE(name.find(tile), std::string::npos) << name << " lacks its tile " << tile;
    EXPECT_NE(std::find(ladder.begin(), ladder.end(), reg[i]->isa), ladder.end()) << name;
    EXPECT_EQ(cpumoe::f8gemm_find(reg[i]->name), reg[i]);
    if (i + 1 < reg.size()) {
      EXPECT_GT(int(reg[i]->isa), int(reg[i + 1]->isa)) << name << " before " << reg[i + 1]->name;
    }
  }
  EXPECT_EQ(cpumoe::f8gemm_find("f8gemm_no_such_kernel"), nullptr);
}

// The selected kernel is printed ("[ selected ] <name> (isa <level>)"), as the other families'.
TEST(F8GemmRegistry, SelectIsTheBestSupportedWithinTheCap) {
  const Isa* env = cpumoe::env_isa_cap();
  for (Isa cap : cpumoe::isa_ladder()) {
    const F8GemmUkernel* k = cpumoe::f8gemm_select(&cap);
    ASSERT_NE(k, nullptr);
    const F8GemmUkernel* want = nullptr;
    for (const F8GemmUkernel* c : cpumoe::f8gemm_registry())
      if (int(c->isa) <= int(cap) && (env == nullptr || int(c->isa) <= int(*env)) &&
          cpumoe::cpu_supports(c->isa)) {
        want = c;
        break;
      }
    EXPECT_EQ(k, want) << cpumoe::isa_name(cap);
  }
  const F8GemmUkernel* sel = cpumoe::f8gemm_select();
  ASSERT_NE(sel, nullptr);
  std::cout << "[ selected ] " << sel->name << " (isa " << cpumoe::isa_name(sel->isa) << ")"
            << std::endl;
}

// cpumoe_f8gemm_test.EnvIsaCapPortable runs this with CPUMOE_ISA=portable (the cap is read once
// per process; see CMakeLists.txt): the selection stays within it.
TEST(F8GemmRegistry, EnvIsaCap) {
  const char* env = std::getenv("CPUMOE_ISA");
  if (env == nullptr || *env == '\0') {
    EXPECT_EQ(cpumoe::env_isa_cap(), nullptr);
    return;
  }
  const Isa* cap = cpumoe::env_isa_cap();
  ASSERT_NE(cap, nullptr);
  const F8GemmUkernel* sel = cpumoe::f8gemm_select();
  ASSERT_NE(sel, nullptr);
  EXPECT_LE(int(sel->isa), int(*cap));
  std::cout << "[ selected ] " << sel->name << " under CPUMOE_ISA=" << env << std::endl;
}

// f8gemm.h's e4m3_value against the oracle's decoding from the fp32 bit fields, for every code:
// the same bits (signed zeros included), NaN exactly for 0x7F and 0xFF.
TEST(E4m3, ValueMatchesTheBitFields) {
  for (int c = 0; c < 256; ++c) {
    const float got = cpumoe::e4m3_value(uint8_t(c)), want = cpumoe_ref::e4m3(uint8_t(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      EXPECT_TRUE(std::isnan(want)) << "code " << c;
    } else {
      EXPECT_FALSE(std::isnan(got)) << "code " << c;
      EXPECT_EQ(std::memcmp(&got, &want, 4), 0) << "code " << c << ": " << got << " vs " << want;
    }
  }
  // Landmarks of the format: the extremes, one, the smallest subnormal and normal, signed zero.
  EXPECT_EQ(cpumoe::e4m3_value(0x7E), 448.0f);
  EXPECT_EQ(cpumoe::e4m3_value(0xFE), -448.0f);
  EXPECT_EQ(cpumoe::e4m3_value(0x38), 1.0f);
  EXPECT_EQ(cpumoe::e4m3_value(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(cpumoe::e4m3_value(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(cpumoe::e4m3_value(0x08), std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::signbit(cpumoe::e4m3_value(0x80)) && cpumoe::e4m3_value(0x80) == 0.0f);
  EXPECT_EQ(cpumoe_ref::e4m3(0x7E), 448.0f);
  EXPECT_EQ(cpumoe_ref::e4m3(0x01), std::ldexp(1.0f, -9));
}

}  // namespace
