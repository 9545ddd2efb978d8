// Every q4gemm (W4A8) microkernel in the registry against the naive oracle, bit for bit, for both
// weight formats and every group size class. Kernels the CPU cannot run are skipped.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "cpumoe/cpu_features.h"
#include "cpumoe/q4gemm.h"
#include "q4gemm_tester.h"
#include "reference/reference.h"
#if defined(CPUMOE_TEST_AVX512_EMU)
#include "avx512emu/q4gemm_avx512_emu.h"
#endif
#if defined(CPUMOE_TEST_AMX_TILE_MODEL)
#include "amx/amx_model_kernels.h"
#endif

namespace {

using cpumoe::Q4GemmUkernel;
using cpumoe::W4Format;
using cpumoe::W4Layout;
using cpumoe_test::GuardedBuffer;
using cpumoe_test::Q4GemmTester;

struct Fmt {
  W4Format f;
  int64_t g;
};

class Q4GemmKernelTest : public testing::TestWithParam<const Q4GemmUkernel*> {
 protected:
  void SetUp() override {
    if (!cpumoe::cpu_supports(kernel().isa))
      GTEST_SKIP() << kernel().name << " needs " << cpumoe::isa_name(kernel().isa)
                   << ", which this CPU lacks";
  }
  const Q4GemmUkernel& kernel() const { return *GetParam(); }
  // kFormats, and int8_affine's 8-bit codes at the same groups where the kernel has them.
  std::vector<Fmt> formats() const;
};

// 32, 64, 128 and mxfp4's 32 are fixed at compile time in the x86 kernels (run_q4_f32); 96 takes
// their general path.
constexpr Fmt kFormats[] = {{W4Format::int4, 32},  {W4Format::int4, 64}, {W4Format::int4, 96},
                            {W4Format::int4, 128}, {W4Format::mxfp4, 32}};

std::vector<Fmt> Q4GemmKernelTest::formats() const {
  std::vector<Fmt> out(std::begin(kFormats), std::end(kFormats));
  if (kernel().codes8)
    for (int64_t g : {32, 64, 96, 128}) out.push_back({W4Format::int8_affine, g});
  return out;
}

// m: every sub-tile of a 16-row tile and past it; n: at, below and above each tile edge
// (nr 4, 8, 16); k: one group, two, and an odd count of groups.
constexpr int64_t kMs[] = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33};
constexpr int64_t kNs[] = {1, 3, 4, 7, 8, 9, 15, 16, 17, 33, 64};

TEST_P(Q4GemmKernelTest, SmallShapes) {
  for (const Fmt& fm : formats())
    for (int64_t groups : {1, 2, 3})
      for (int64_t m : kMs)
        for (int64_t n : kNs) {
          Q4GemmTester().format(fm.f).group(fm.g).m(m).n(n).k(groups * fm.g).Test(kernel());
          if (HasFatalFailure()) return;
        }
}

// Activations quantized per group (lhs_group_scale): every format and group, tile edges in m
// and n, one to three groups, the scales with tiny and huge values among them.
TEST_P(Q4GemmKernelTest, GroupScales) {
  for (const Fmt& fm : formats())
    for (int64_t groups : {1, 3})
      for (int64_t m : {1, 2, 4, 5, 8, 9, 17})
        for (int64_t n : {3, 8, 17, 33}) {
          Q4GemmTester().format(fm.f).group(fm.g).m(m).n(n).k(groups * fm.g).group_scales(true)
              .Test(kernel());
          if (HasFatalFailure()) return;
        }
  Q4GemmTester().format(W4Format::int4).group(12288).m(3).n(10).k(24576).group_scales(true)
      .offsets(false).Test(kernel());
}

// Group sizes beyond 128 (any multiple of 32 that divides K) and real depths: gpt-oss's 2880
// (groups of 32 and 64), Qwen3's 2048 and 768.
TEST_P(Q4GemmKernelTest, DeepKAndOtherGroups) {
  struct Shape { int64_t m, n, k, g; W4Format f; };
  for (Shape s : {Shape{1, 16, 2880, 32, W4Format::mxfp4}, {9, 33, 2880, 64, W4Format::int4},
                  {17, 16, 2048, 128, W4Format::int4}, {1, 64, 768, 128, W4Format::int4},
                  {5, 17, 768, 96, W4Format::int4}, {3, 9, 1024, 256, W4Format::int4},
                  {2, 8, 4096, 4096, W4Format::int4}, {33, 20, 2048, 32, W4Format::mxfp4}}) {
    Q4GemmTester().format(s.f).group(s.g).m(s.m).n(s.n).k(s.k).Test(kernel());
    if (HasFatalFailure()) return;
  }
  if (!kernel().codes8) return;
  for (Shape s : {Shape{1, 64, 2048, 32, W4Format::int8_affine},
                  {9, 33, 2880, 64, W4Format::int8_affine},
                  {5, 17, 768, 256, W4Format::int8_affine},
                  {2, 8, 4096, 4096, W4Format::int8_affine}}) {
    Q4GemmTester().format(s.f).group(s.g).m(s.m).n(s.n).k(s.k).Test(kernel());
    if (HasFatalFailure()) return;
  }
}

// E8M0 0, 1 (subnormal scales), 254 and 255 (NaN: its column is NaN in every row); int4 scales
// of 1e-30 and 1e30.
TEST_P(Q4GemmKernelTest, ExtremeScales) {
  for (const Fmt& fm : formats())
    for (int64_t m : {1, 8, 17})
      for (int64_t n : {5, 16, 33}) {
        Q4GemmTester().format(fm.f).group(fm.g).m(m).n(n).k(4 * fm.g).extreme_scales(true)
            .Test(kernel());
        if (HasFatalFailure()) return;
      }
}

// The largest |product| everywhere at the deepest group: 127 * -8 (int4) and 127 * -12 (mxfp4)
// summed over a whole group of 4096 k, exact in int32 and in the float conversion.
TEST_P(Q4GemmKernelTest, LargestGroupSums) {
  Q4GemmTester().format(W4Format::int4).group(4096).m(9).n(17).k(8192).constant(127, 8)
      .Test(kernel());
  Q4GemmTester().format(W4Format::mxfp4).group(32).m(9).n(17).k(2048).constant(-127, 15)
      .Test(kernel());
  if (!kernel().codes8) return;  // 8-bit codes: -128 * 127 and 127 * 127 over 4096 k
  Q4GemmTester().format(W4Format::int8_affine).group(4096).m(9).n(17).k(8192).constant(127, 0)
      .Test(kernel());
  Q4GemmTester().format(W4Format::int8_affine).group(4096).m(9).n(17).k(8192).constant(-127, 255)
      .Test(kernel());
}

// Groups longer than 8192 k, beyond which a group's fp32 partial sums could stop being exact
// integers: the BFMMLA kernel sums such groups in int32 over pieces of 8192 k (one piece and a
// half piece here), at the largest |product| and random.
TEST_P(Q4GemmKernelTest, LongGroups) {
  Q4GemmTester().format(W4Format::int4).group(16384).m(5).n(9).k(16384).constant(127, 8)
      .Test(kernel());
  if (HasFatalFailure()) return;
  Q4GemmTester().format(W4Format::int4).group(12288).m(3).n(10).k(24576).offsets(false)
      .Test(kernel());
}

// Packing writes every byte of the packed size: the result depends neither on what the buffer
// held before, nor on anything past k / k / g in the rows, nor on the codes' high 4 bits.
TEST_P(Q4GemmKernelTest, PackingIsFullyDetermined) {
  std::mt19937 rng(5);
  for (const Fmt& fm : formats()) {
    const W4Layout w{fm.f, fm.g};
    const uint8_t high = w.code_bits() == 8 ? 0 : 0xf0;  // bits the packer must ignore
    for (int64_t n : {1, 3, 9, 17}) {
      const int64_t k = 2 * fm.g, ldc = k + 7, lds = 2 + 3, sb = w.scale_bytes();
      std::vector<uint8_t> codes(size_t(n * ldc)), sc(size_t(n * lds * sb));
      for (auto& v : codes) v = uint8_t(rng() & ~high);
      for (auto& v : sc) v = uint8_t(60 + rng() % 8);  // positive finite floats / E8M0
      std::vector<uint8_t> codes2 = codes, sc2 = sc;
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t x = 0; x < k; ++x) codes2[size_t(j * ldc + x)] |= uint8_t(rng() & high);
        for (int64_t x = k; x < ldc; ++x) codes2[size_t(j * ldc + x)] = uint8_t(rng());
        for (int64_t x = 2 * sb; x < lds * sb; ++x) sc2[size_t(j * lds * sb + x)] = uint8_t(rng());
      }
      const size_t rs = kernel().rhs_packed_size(n, k, w);
      std::vector<uint8_t> r0(rs, 0x00), r1(rs, 0xff);
      // Nor on what its scratch held: 0x00 for one call, 0xff for the other.
      const size_t ps = kernel().pack_scratch_bytes(n, k, w);
      GuardedBuffer s0(ps), s1(ps);
      std::memset(s0.data(), 0x00, ps);
      std::memset(s1.data(), 0xff, ps);
      kernel().pack_rhs(n, k, w, codes.data(), ldc, sc.data(), lds, r0.data(), s0.data());
      kernel().pack_rhs(n, k, w, codes2.data(), ldc, sc2.data(), lds, r1.data(), s1.data());
      EXPECT_TRUE(s0.guard_intact() && s1.guard_intact()) << "pack_rhs wrote past its scratch";
      EXPECT_EQ(r0, r1) << cpumoe::w4_format_name(fm.f) << " n=" << n
                        << ": pack_rhs left bytes unwritten, read past the group scales or "
                           "read a code's high bits or its scratch's old contents";
    }
  }
}

// The packed weights are what the format is for: 4 bits per weight (8 for int8_affine's codes)
// plus the group scales (and at most a 64-byte alignment pad per block). A kernel may store
// mxfp4's E8M0 scales widened to bf16 (exact), no wider.
TEST_P(Q4GemmKernelTest, PackedBytesAreFourBitsPlusScales) {
  for (const Fmt& fm : formats()) {
    const W4Layout w{fm.f, fm.g};
    const int64_t max_sb = fm.f == W4Format::mxfp4 ? 2 : w.scale_bytes();
    for (int64_t n : {kernel().nr, int64_t(64), int64_t(768)}) {
      for (int64_t k : {int64_t(768), int64_t(2048)}) {
      if (k % fm.g != 0) continue;  // g 96 and 2048
      const size_t bytes = kernel().rhs_packed_size(n, k, w);
      const size_t blocks = size_t((n + kernel().nr - 1) / kernel().nr);
      const auto want = [&](int64_t sb) {
        return blocks * size_t(kernel().nr) * size_t(k * w.code_bits() / 8 + (k / fm.g) * sb);
      };
      EXPECT_GE(bytes, want(w.scale_bytes()));
      EXPECT_LE(bytes, want(max_sb) + blocks * 64) << cpumoe::w4_format_name(fm.f) << " g=" << fm.g;
      for (int64_t j = kernel().nr; j < n; j += kernel().nr)
        ASSERT_EQ(kernel().rhs_packed_offset(j, k, w) % 64, 0u) << j;
      }
    }
  }
}

TEST_P(Q4GemmKernelTest, PackingInRowPiecesMatchesOneCall) {
  cpumoe_test::expect_lhs_packs_in_row_pieces<Q4GemmUkernel, int8_t>(
      kernel(), [](size_t i) { return int8_t(int(i * 37 % 255) - 127); });
}

TEST_P(Q4GemmKernelTest, EmptyShapesWriteNothing) {
  const W4Layout w{W4Format::int4, 32};
  const int64_t k = 64;
  std::vector<int8_t> a(size_t(8 * k), 1);
  std::vector<const int8_t*> rows(8, a.data());
  std::vector<uint8_t> codes(size_t(8 * k), 3);
  std::vector<float> sc(16, 1.0f);
  GuardedBuffer lhs(kernel().lhs_packed_size(8, k)), rhs(kernel().rhs_packed_size(8, k, w));
  kernel().pack_lhs(8, k, rows.data(), lhs.data());
  GuardedBuffer pscratch(kernel().pack_scratch_bytes(8, k, w));
  kernel().pack_rhs(8, k, w, codes.data(), k, sc.data(), 2, rhs.data(), pscratch.data());
  const std::vector<float> ls(8, 1.0f);
  for (auto [m, n] : {std::pair<int64_t, int64_t>{0, 8}, {8, 0}, {0, 0}}) {
    ASSERT_EQ(kernel().scratch_bytes(m, n, k, w), 0u) << "m=" << m << " n=" << n;
    std::vector<float> dst(64, -1.0f);
    kernel().run_f32(m, n, k, w, lhs.data(), rhs.data(), dst.data(), 8, {ls.data(), nullptr});
    for (float v : dst) ASSERT_EQ(v, -1.0f) << "m=" << m << " n=" << n;
  }
}

// The dispatcher reserves scratch_bytes once at the largest shape it calls (the MoE planner: a
// task's rows and columns), so it must not shrink as m or n grow; and it stays a small multiple
// of the call's own data (no hidden m x n buffers).
TEST_P(Q4GemmKernelTest, ScratchBytesIsMonotoneAndBounded) {
  std::vector<W4Layout> layouts{{W4Format::int4, 32}, {W4Format::int4, 128},
                                {W4Format::int4, 2048}, {W4Format::mxfp4, 32}};
  if (kernel().codes8) layouts.push_back({W4Format::int8_affine, 128});
  for (const W4Layout w : layouts) {
    for (int64_t k : {w.group, 4 * w.group}) {
      for (int64_t m = 0; m <= 70; ++m) {
        for (int64_t n : {int64_t(0), int64_t(1), int64_t(31), int64_t(33), int64_t(1536)}) {
          SCOPED_TRACE(testing::Message() << cpumoe::w4_format_name(w.format) << " g=" << w.group
                                          << " k=" << k << " m=" << m << " n=" << n);
          const size_t b = kernel().scratch_bytes(m, n, k, w);
          ASSERT_LE(b, kernel().scratch_bytes(m + 1, n, k, w));
          ASSERT_LE(b, kernel().scratch_bytes(m, n + 1, k, w));
          ASSERT_LE(b, size_t(64 * (m + 8) * (k + w.group) + 64)) << "beyond the call's size";
        }
      }
    }
  }
}

std::string KernelName(const testing::TestParamInfo<const Q4GemmUkernel*>& info) {
  return info.param->name;
}

#if defined(CPUMOE_TEST_AVX512_EMU)
// The AVX-512 kernels' code over SIMDe (tests_cpp/avx512emu), in a binary of its own.
INSTANTIATE_TEST_SUITE_P(Avx512Emu, Q4GemmKernelTest,
                         testing::Values(&cpumoe_test::q4gemm_avx512_vnni_simde), KernelName);
#elif defined(CPUMOE_TEST_AMX_TILE_MODEL)
// The AMX kernel's code over the tile model (tests_cpp/amx), in a binary of its own.
INSTANTIATE_TEST_SUITE_P(AmxTileModel, Q4GemmKernelTest,
                         testing::Values(&cpumoe_test::q4gemm_amx_tilemodel), KernelName);
#else
INSTANTIATE_TEST_SUITE_P(Registry, Q4GemmKernelTest, testing::ValuesIn(cpumoe::q4gemm_registry()),
                         KernelName);
#endif

// The registry best first by level, each name in the grammar with its tile and level; select takes
// the best kernel this CPU runs within the cap (and CPUMOE_ISA). The selected kernel is printed
// ("[ selected ] <name> (isa <level>)"): ci/test_all.sh's x86-haswell stage checks it is the AVX2
// one there.
TEST(Q4GemmRegistry, OrderedNamedAndSelectedWithinTheCap) {
  const auto& reg = cpumoe::q4gemm_registry();
  ASSERT_FALSE(reg.empty());
  EXPECT_EQ(reg.back()->isa, cpumoe::Isa::portable);
  for (size_t i = 0; i < reg.size(); ++i) {
    const std::string name = reg[i]->name;
    EXPECT_EQ(name.rfind("q4gemm_", 0), 0u) << name;
    const std::string tail = std::string("_") + cpumoe::isa_name(reg[i]->isa);
    EXPECT_EQ(name.compare(name.size() - tail.size(), tail.size(), tail), 0) << name;
    const std::string tile = "_" + std::to_string(reg[i]->mr) + "x" + std::to_string(reg[i]->nr) + "_";
    EXPECT_NE(name.find(tile), std::string::npos) << name << " lacks its tile " << tile;
    EXPECT_EQ(cpumoe::q4gemm_find(reg[i]->name), reg[i]);
    if (i + 1 < reg.size()) {
      EXPECT_GT(int(reg[i]->isa), int(reg[i + 1]->isa)) << name;
    }
  }
  const cpumoe::Isa* env = cpumoe::env_isa_cap();
  for (cpumoe::Isa cap : cpumoe::isa_ladder()) {
    const Q4GemmUkernel* want = nullptr;
    for (const Q4GemmUkernel* c : reg)
      if (int(c->isa) <= int(cap) && (env == nullptr || int(c->isa) <= int(*env)) &&
          cpumoe::cpu_supports(c->isa)) {
        want = c;
        break;
      }
    EXPECT_EQ(cpumoe::q4gemm_select(&cap), want) << cpumoe::isa_name(cap);
  }
  const Q4GemmUkernel* sel = cpumoe::q4gemm_select();
  std::cout << "[ selected ] " << sel->name << " (isa " << cpumoe::isa_name(sel->isa) << ")"
            << std::endl;
}

// The decode tables against the formats' definitions (the oracle's own decoding).
TEST(W4Format, DecodeTablesAndScales) {
  for (W4Format f : {W4Format::int4, W4Format::mxfp4})
    for (int c = 0; c < 16; ++c)
      EXPECT_EQ(cpumoe::w4_decode_table(f)[c], cpumoe_ref::w4_value(f, uint8_t(c)))
          << cpumoe::w4_format_name(f) << " code " << c;
  for (int e = 0; e < 256; ++e) {
    const uint8_t b = uint8_t(e);
    const float got = cpumoe::w4_mxfp4_scale(b), want = cpumoe_ref::w4_scale(W4Format::mxfp4, &b, 0);
    if (e == 255) {
      EXPECT_TRUE(std::isnan(got));
    } else {
      EXPECT_EQ(std::memcmp(&got, &want, 4), 0) << "e=" << e;
    }
  }
}

}  // namespace
