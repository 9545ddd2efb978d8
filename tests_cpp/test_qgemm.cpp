// Every qgemm microkernel in the registry against the naive int32 GEMM, bit for bit. Kernels the
// CPU cannot run are skipped (they are compiled in, but executing them would SIGILL).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpumoe/cpu_features.h"
#include "cpumoe/qgemm.h"
#include "qgemm_tester.h"
#include "reference/reference.h"
#if defined(CPUMOE_TEST_AMX_TILE_MODEL)
#include "amx/amx_model_kernels.h"
#endif

namespace {

using cpumoe::QGemmUkernel;
using cpumoe_test::GuardedBuffer;
using cpumoe_test::QGemmTester;

class QGemmKernelTest : public testing::TestWithParam<const QGemmUkernel*> {
 protected:
  void SetUp() override {
    if (!cpumoe::cpu_supports(kernel().isa))
      GTEST_SKIP() << kernel().name << " needs " << cpumoe::isa_name(kernel().isa)
                   << ", which this CPU lacks";
  }
  const QGemmUkernel& kernel() const { return *GetParam(); }

  // C = A B^T for row-major A [m][k] and B [n][k] (row stride ldb, 0: k) through run_f32 with
  // unit scales and no bias: float(C), which is C itself while |C| <= 2^24.
  std::vector<float> run_unit(int64_t m, int64_t n, int64_t k, const std::vector<int8_t>& a,
                              const std::vector<int8_t>& b, int64_t ldb = 0) const {
    std::vector<const int8_t*> rows(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) rows[size_t(i)] = a.data() + i * k;
    GuardedBuffer lhs(kernel().lhs_packed_size(m, k)), rhs(kernel().rhs_packed_size(n, k));
    kernel().pack_lhs(m, k, rows.data(), lhs.data());
    kernel().pack_rhs(n, k, b.data(), ldb > 0 ? ldb : k, rhs.data());
    const std::vector<float> ones(size_t(std::max(m, n)), 1.0f);
    std::vector<float> c(size_t(m * n), 0.0f);
    kernel().run_f32(m, n, k, lhs.data(), rhs.data(), c.data(), n,
                     {ones.data(), ones.data(), nullptr});
    return c;
  }
};

// m: every sub-tile of the 8-row tile and past it; n and k: at, below and above each tile edge
// (nr = 4 and 8, kr = 8 and 16 in the current kernels).
constexpr int64_t kMs[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33};
constexpr int64_t kNs[] = {1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 33, 64};
constexpr int64_t kKs[] = {1, 7, 8, 9, 15, 16, 17, 64, 72};

TEST_P(QGemmKernelTest, SmallShapes) {
  for (int64_t k : kKs)
    for (int64_t m : kMs)
      for (int64_t n : kNs) {
        QGemmTester().m(m).n(n).k(k).Test(kernel());
        if (HasFatalFailure()) return;
      }
}

TEST_P(QGemmKernelTest, DeepK) {
  struct Shape { int64_t m, n, k; };
  for (Shape s : {Shape{1, 1, 2880}, {7, 17, 2880}, {16, 64, 2880}, {33, 9, 2880}, {1, 8, 4096},
                  {9, 33, 4096}, {17, 16, 4096}}) {
    QGemmTester().m(s.m).n(s.n).k(s.k).Test(kernel());
    if (HasFatalFailure()) return;
  }
}

// The last 9-12 rows of a call (5 or 6 row pairs over two 8-row blocks: one tile in the i8mm
// kernel), with k covering its 32-, 8- and single-slice loops (k = 264: 32 + 1 slices, 328:
// 32 + 8 + 1) and n with full and partial last blocks.
TEST_P(QGemmKernelTest, RowTilesAcrossBlocks) {
  for (int64_t k : {8, 264, 328})
    for (int64_t m : {10, 11, 12, 19, 20, 27, 28})
      for (int64_t n : {8, 56, 57}) {
        QGemmTester().m(m).n(n).k(k).Test(kernel());
        if (HasFatalFailure()) return;
      }
}

// The extreme sum: 65536 products of 127 * -128 = -1065353216, which still fits int32. A kernel
// that accumulates in int16 or saturates would fail.
TEST_P(QGemmKernelTest, LargeKNoInt32Overflow) {
  constexpr int64_t kK = 65536;
  static_assert(-127LL * 128 * kK == -1065353216LL, "the extreme sum");
  QGemmTester().m(3).n(9).k(kK).constant(127, -128).Test(kernel());
  QGemmTester().m(2).n(5).k(kK).constant(-127, -128).Test(kernel());

  // And directly, without the oracle in between (unit scales: dst = float(C)).
  const int64_t m = 2, n = 9;
  std::vector<int8_t> a(size_t(m * kK), 127), b(size_t(n * kK), -128);
  EXPECT_EQ(run_unit(m, n, kK, a, b), std::vector<float>(size_t(m * n), -1065353216.0f))
      << "127 * 2^23: exact in fp32";

  // The partial sums reach -127 * 128 * 2^15 = -532676608 and come back to a total that fp32
  // holds exactly: every bit of the int32 sum is checked, at the largest depth.
  for (int64_t x = kK / 2; x < kK; ++x)
    for (int64_t j = 0; j < n; ++j) b[size_t(j * kK + x)] = 127;
  EXPECT_EQ(run_unit(m, n, kK, a, b), std::vector<float>(size_t(m * n), -127.0f * 32768.0f));
}

TEST_P(QGemmKernelTest, StridesAndPadding) {
  struct Shape { int64_t m, n, k, row_pad, dst_pad; };
  for (Shape s : {Shape{5, 9, 17, 0, 0}, {8, 8, 8, 0, 0}, {17, 33, 72, 0, 1}, {9, 17, 16, 64, 17},
                  {33, 15, 9, 1, 64}, {16, 64, 64, 3, 0}}) {
    QGemmTester().m(s.m).n(s.n).k(s.k).row_padding(s.row_pad).dst_padding(s.dst_pad).Test(kernel());
    if (HasFatalFailure()) return;
  }
}

// Destination rows of whole, aligned 64-byte lines (row stride a multiple of 16 floats), where
// QGemmEpilogue::stream_dst lets the AVX-512 kernels store past the caches: same values.
TEST_P(QGemmKernelTest, AlignedDestinationRows) {
  for (int64_t m : {1, 8, 17, 40})
    for (int64_t n : {16, 48, 50})
      for (int64_t k : {64, 200}) {
        QGemmTester().m(m).n(n).k(k).dst_padding((16 - n % 16) % 16).Test(kernel());
        if (HasFatalFailure()) return;
      }
}

TEST_P(QGemmKernelTest, EmptyShapesWriteNothing) {
  const std::vector<float> ones(8, 1.0f);
  cpumoe_test::for_empty_shapes(kernel(), int8_t(1), [&](int64_t m, int64_t n, int64_t k, const void* lhs,
                                            const void* rhs) {
    std::vector<float> f(64, 77.0f);
    kernel().run_f32(m, n, k, lhs, rhs, f.data(), 8, {ones.data(), ones.data(), ones.data()});
    for (float v : f) ASSERT_EQ(v, 77.0f);
  });
}

// One-hot rows of A read the packed B back: C[i][j] = B[j][i]. Checks that packing keeps every
// element (including -128) where the kernel expects it.
TEST_P(QGemmKernelTest, PackRoundTripOneHot) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> d(-128, 127);
  for (int64_t k : {1, 7, 8, 9, 16, 17, 33}) {
    for (int64_t n : {1, 3, 8, 9, 17}) {
      SCOPED_TRACE(testing::Message() << "k=" << k << " n=" << n);
      const int64_t ldb = k + 2;
      std::vector<int8_t> b(size_t(n * ldb));
      for (auto& v : b) v = int8_t(d(rng));
      b[0] = -128;
      // Row i of A is one-hot at i, so C[i][j] = B[j][i]; B is stored with a stride > k.
      std::vector<int8_t> onehot(size_t(k * k), 0);
      for (int64_t i = 0; i < k; ++i) onehot[size_t(i * k + i)] = 1;
      const std::vector<float> c = run_unit(k, n, k, onehot, b, ldb);
      for (int64_t i = 0; i < k; ++i)
        for (int64_t j = 0; j < n; ++j)
          ASSERT_EQ(c[size_t(i * n + j)], float(b[size_t(j * ldb + i)])) << i << " " << j;
    }
  }
}

// Packing writes every byte of the packed size (zero padding included): the result does not
// depend on what the buffer held before, nor on the bytes between k and the row stride.
TEST_P(QGemmKernelTest, PackingIsFullyDetermined) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> d(-128, 127);
  for (int64_t k : {1, 9, 17, 72}) {
    for (int64_t mn : {1, 3, 9, 17}) {
      SCOPED_TRACE(testing::Message() << "k=" << k << " m=n=" << mn);
      const int64_t ld = k + 7;
      std::vector<int8_t> src(size_t(mn * ld)), src2;
      for (auto& v : src) v = int8_t(d(rng));
      src2 = src;
      for (int64_t r = 0; r < mn; ++r)
        for (int64_t x = k; x < ld; ++x) src2[size_t(r * ld + x)] = int8_t(d(rng));
      std::vector<const int8_t*> rows(static_cast<size_t>(mn)), rows2(static_cast<size_t>(mn));
      for (int64_t r = 0; r < mn; ++r) {
        rows[size_t(r)] = src.data() + r * ld;
        rows2[size_t(r)] = src2.data() + r * ld;
      }
      const size_t ls = kernel().lhs_packed_size(mn, k), rs = kernel().rhs_packed_size(mn, k);
      std::vector<uint8_t> l0(ls, 0x00), l1(ls, 0xff), r0(rs, 0x00), r1(rs, 0xff);
      kernel().pack_lhs(mn, k, rows.data(), l0.data());
      kernel().pack_lhs(mn, k, rows2.data(), l1.data());
      kernel().pack_rhs(mn, k, src.data(), ld, r0.data());
      kernel().pack_rhs(mn, k, src2.data(), ld, r1.data());
      EXPECT_EQ(l0, l1) << "pack_lhs left bytes unwritten or read past k";
      EXPECT_EQ(r0, r1) << "pack_rhs left bytes unwritten or read past k";
    }
  }
}

TEST_P(QGemmKernelTest, PackingInRowPiecesMatchesOneCall) {
  cpumoe_test::expect_lhs_packs_in_row_pieces<QGemmUkernel, int8_t>(
      kernel(), [](size_t i) { return int8_t(int(i * 37 % 255) - 127); });
}

TEST_P(QGemmKernelTest, PackedSizesAndOffsetsAreConsistent) {
  cpumoe_test::expect_packed_sizes_consistent(kernel(), 1);
}

std::string KernelName(const testing::TestParamInfo<const QGemmUkernel*>& info) {
  return info.param->name;
}

#if defined(CPUMOE_TEST_AMX_TILE_MODEL)
// The AMX kernels' code over the tile model (tests_cpp/amx), in a binary of its own.
INSTANTIATE_TEST_SUITE_P(AmxTileModel, QGemmKernelTest,
                         testing::Values(&cpumoe_test::qgemm_amx_tilemodel), KernelName);
#else
INSTANTIATE_TEST_SUITE_P(Registry, QGemmKernelTest, testing::ValuesIn(cpumoe::qgemm_registry()),
                         KernelName);
#endif

}  // namespace
