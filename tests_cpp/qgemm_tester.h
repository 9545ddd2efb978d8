/// @file qgemm_tester.h
/// A builder-style tester for one QGemmUkernel (XNNPACK style):
///   QGemmTester().m(7).n(17).k(72).Test(kernel);
/// It packs random int8 operands through the kernel's own packers (row pointers for A, a row
/// stride > k for B), runs run_f32 (unit scales, which give the int32 sums; random scales without
/// and with bias) over the whole problem and at m / n offsets taken at multiples of mr / nr, and
/// compares each with the naive oracle bit for bit. It also checks that packing stays inside the packed size and that nothing outside the
/// destination block is written.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cpumoe/qgemm.h"
#include "reference/reference.h"

namespace cpumoe_test {

/// 64-byte aligned bytes with a guard zone after `size`, pre-filled with a known pattern.
class GuardedBuffer {
 public:
  static constexpr size_t kGuard = 64;
  static constexpr uint8_t kPattern = 0xa5;
  explicit GuardedBuffer(size_t size) : size_(size) {
    const size_t total = (size + kGuard + 63) / 64 * 64;
    p_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, total)));
    std::memset(p_.get(), kPattern, total);
  }
  uint8_t* data() const { return p_.get(); }
  bool guard_intact() const {
    for (size_t i = 0; i < kGuard; ++i)
      if (p_.get()[size_ + i] != kPattern) return false;
    return true;
  }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  size_t size_;
  std::unique_ptr<uint8_t, Free> p_;
};

/// A sub-block of a tester's problem: rows [m0, m0 + mc), columns [n0, n0 + nc).
struct Block {
  int64_t m0, mc, n0, nc;
  bool contains(int64_t i, int64_t j) const {
    return i >= m0 && i < m0 + mc && j >= n0 && j < n0 + nc;
  }
};

/// Blocks of an m x n problem at the first and the last tile boundary of @p kern (any kernel
/// family), each with the rest of the problem and with a shorter random extent (the dispatcher
/// calls both ways).
template <class Kernel>
void add_offset_blocks(const Kernel& kern, int64_t m, int64_t n, std::mt19937& rng,
                       std::vector<Block>* blocks) {
  std::vector<int64_t> m0s{0}, n0s{0};
  if (m > kern.mr) m0s.push_back(kern.mr);
  if ((m - 1) / kern.mr * kern.mr > kern.mr) m0s.push_back((m - 1) / kern.mr * kern.mr);
  if (n > kern.nr) n0s.push_back(kern.nr);
  if ((n - 1) / kern.nr * kern.nr > kern.nr) n0s.push_back((n - 1) / kern.nr * kern.nr);
  for (int64_t m0 : m0s) {
    for (int64_t n0 : n0s) {
      if (m0 == 0 && n0 == 0) continue;
      blocks->push_back({m0, m - m0, n0, n - n0});
      const int64_t mc = 1 + int64_t(rng() % uint32_t(m - m0));
      const int64_t nc = 1 + int64_t(rng() % uint32_t(n - n0));
      blocks->push_back({m0, mc, n0, nc});
    }
  }
}

/// The packed sizes and offsets of @p kn (any kernel family; packed elements of @p elem_bytes
/// bytes) are consistent: at least the elements, growing with m, offsets 0 at 0, a call at any
/// tile offset inside the whole buffer, packed B offsets 64-byte aligned (PackedMoe keeps whole
/// blocks).
template <class Kernel>
void expect_packed_sizes_consistent(const Kernel& kn, size_t elem_bytes) {
  EXPECT_GE(kn.mr, 1);
  EXPECT_GE(kn.nr, 1);
  EXPECT_GE(kn.kr, 1);
  for (int64_t k : {1, 7, 8, 9, 16, 17, 64, 2880}) {
    const int64_t kp = cpumoe::round_up(k, kn.kr);
    for (int64_t m = 0; m <= 40; ++m) {
      SCOPED_TRACE(testing::Message() << "k=" << k << " m=n=" << m);
      const size_t lsize = kn.lhs_packed_size(m, k), rsize = kn.rhs_packed_size(m, k);
      ASSERT_GE(lsize, size_t(m * kp) * elem_bytes);
      ASSERT_GE(rsize, size_t(m * kp) * elem_bytes);
      ASSERT_GE(kn.lhs_packed_size(m + 1, k), lsize);
      ASSERT_GE(kn.rhs_packed_size(m + 1, k), rsize);
      ASSERT_EQ(kn.lhs_packed_offset(0, k), 0u);
      ASSERT_EQ(kn.rhs_packed_offset(0, k), 0u);
      // A call at a tile offset reads a block of the shape's packed size for the remaining rows:
      // it must lie inside the whole packed buffer.
      for (int64_t i = kn.mr; i < m; i += kn.mr)
        ASSERT_LE(kn.lhs_packed_offset(i, k) + kn.lhs_packed_size(m - i, k), lsize) << i;
      for (int64_t j = kn.nr; j < m; j += kn.nr) {
        ASSERT_LE(kn.rhs_packed_offset(j, k) + kn.rhs_packed_size(m - j, k), rsize) << j;
        ASSERT_EQ(kn.rhs_packed_offset(j, k) % 64, 0u) << j;
      }
    }
  }
}

/// Packing A in row pieces that start at multiples of mr, each at lhs_packed_offset(m0), writes
/// the bytes one call for all rows writes (the dispatcher packs an expert's row chunks in
/// separate tasks). @p elem makes element i of the source (Elem: int8_t or bf16 bits).
template <class Kernel, class Elem, class MakeElem>
void expect_lhs_packs_in_row_pieces(const Kernel& kn, const MakeElem& elem) {
  for (int64_t k : {1, 17, 72, 136}) {
    for (int64_t m : {kn.mr, 2 * kn.mr + 3, 5 * kn.mr}) {
      for (int64_t piece : {kn.mr, 2 * kn.mr}) {
        SCOPED_TRACE(testing::Message() << "k=" << k << " m=" << m << " piece=" << piece);
        std::vector<Elem> src(size_t(m * k));
        for (size_t i = 0; i < src.size(); ++i) src[i] = elem(i);
        std::vector<const Elem*> rows(static_cast<size_t>(m));
        for (int64_t r = 0; r < m; ++r) rows[size_t(r)] = src.data() + r * k;
        const size_t ls = kn.lhs_packed_size(m, k);
        std::vector<uint8_t> whole(ls, 0x5a), pieces(ls, 0x5a);
        kn.pack_lhs(m, k, rows.data(), whole.data());
        for (int64_t m0 = 0; m0 < m; m0 += piece)
          kn.pack_lhs(std::min(piece, m - m0), k, rows.data() + m0,
                      pieces.data() + kn.lhs_packed_offset(m0, k));
        ASSERT_EQ(whole, pieces);
      }
    }
  }
}

/// Packs 8 rows of A and 8 columns of B of depth 16, every element @p one, and calls
/// run(m, n, k, lhs, rhs) for the empty shapes 0 x 8, 8 x 0 and 0 x 0 (the caller runs the
/// kernel into a pre-filled output and checks that nothing was written).
template <class Kernel, class Elem, class Run>
void for_empty_shapes(const Kernel& kn, Elem one, const Run& run) {
  const int64_t k = 16;
  std::vector<Elem> data(size_t(8 * k), one);
  std::vector<const Elem*> rows(8, data.data());
  GuardedBuffer lhs(kn.lhs_packed_size(8, k)), rhs(kn.rhs_packed_size(8, k));
  kn.pack_lhs(8, k, rows.data(), lhs.data());
  kn.pack_rhs(8, k, data.data(), k, rhs.data());
  for (auto [m, n] : {std::pair<int64_t, int64_t>{0, 8}, {8, 0}, {0, 0}}) {
    SCOPED_TRACE(testing::Message() << "m=" << m << " n=" << n);
    run(m, n, k, lhs.data(), rhs.data());
  }
}

class QGemmTester {
 public:
  QGemmTester& m(int64_t v) { m_ = v; return *this; }
  QGemmTester& n(int64_t v) { n_ = v; return *this; }
  QGemmTester& k(int64_t v) { k_ = v; return *this; }
  /// Extra elements after k in each stored row of A and B (ignored garbage the packers must skip).
  QGemmTester& row_padding(int64_t v) { pad_ = v; return *this; }
  /// Extra columns after n in each destination row (must stay untouched).
  QGemmTester& dst_padding(int64_t v) { dst_pad_ = v; return *this; }
  /// Instead of random data: A all `a`, B all `b` (the int32 range test).
  QGemmTester& constant(int8_t a, int8_t b) { const_ = true; ca_ = a; cb_ = b; return *this; }
  /// Also call the kernel on sub-blocks at m / n offsets.
  QGemmTester& offsets(bool v) { offsets_ = v; return *this; }
  QGemmTester& seed(uint32_t v) { seed_ = v; return *this; }

  void Test(const cpumoe::QGemmUkernel& kern) const {
    SCOPED_TRACE(testing::Message() << kern.name << " m=" << m_ << " n=" << n_ << " k=" << k_);
    std::mt19937 rng(seed_ ^ uint32_t(m_ * 7919 + n_ * 104729 + k_));
    const int64_t lda = k_ + pad_, ldb = k_ + pad_, ldd = n_ + dst_pad_;

    // A: quantized activations, [-127, 127]; B: weights, the full int8 range.
    std::vector<int8_t> a_store(size_t(m_ * lda)), b(size_t(n_ * ldb));
    fill(a_store, -127, 127, ca_, rng);
    fill(b, -128, 127, cb_, rng);
    if (!const_) {
      // The extremes, at the first and last element and a few random places.
      a_store[0] = 127;
      a_store[size_t((m_ - 1) * lda + k_ - 1)] = -127;
      b[0] = -128;
      b[size_t((n_ - 1) * ldb + k_ - 1)] = 127;
      for (int r = 0; r < 4; ++r) {
        a_store[size_t(int64_t(rng() % uint32_t(m_)) * lda + int64_t(rng() % uint32_t(k_)))] =
            r % 2 ? int8_t(-127) : int8_t(127);
        b[size_t(int64_t(rng() % uint32_t(n_)) * ldb + int64_t(rng() % uint32_t(k_)))] =
            r % 2 ? int8_t(-128) : int8_t(127);
      }
    }
    // Logical row i of A is stored row m-1-i: pack_lhs must follow the row pointers.
    std::vector<const int8_t*> rows(static_cast<size_t>(m_));
    std::vector<int8_t> a(size_t(m_ * k_));
    for (int64_t i = 0; i < m_; ++i) {
      rows[size_t(i)] = a_store.data() + (m_ - 1 - i) * lda;
      std::memcpy(a.data() + i * k_, rows[size_t(i)], size_t(k_));
    }

    std::vector<int32_t> ref(size_t(m_ * n_));
    cpumoe_ref::gemm_s32(m_, n_, k_, a.data(), k_, b.data(), ldb, ref.data(), n_);

    const size_t lhs_size = kern.lhs_packed_size(m_, k_), rhs_size = kern.rhs_packed_size(n_, k_);
    GuardedBuffer lhs(lhs_size), rhs(rhs_size);
    kern.pack_lhs(m_, k_, rows.data(), lhs.data());
    kern.pack_rhs(n_, k_, b.data(), ldb, rhs.data());
    ASSERT_TRUE(lhs.guard_intact()) << "pack_lhs wrote past lhs_packed_size";
    ASSERT_TRUE(rhs.guard_intact()) << "pack_rhs wrote past rhs_packed_size";

    std::vector<float> ls(static_cast<size_t>(m_)), rs(static_cast<size_t>(n_)), bias(static_cast<size_t>(n_));
    std::uniform_real_distribution<float> scale(1e-4f, 2.0f), bdist(-5.0f, 5.0f);
    for (auto& v : ls) v = scale(rng);
    for (auto& v : rs) v = scale(rng);
    for (auto& v : bias) v = bdist(rng);
    const std::vector<float> ones(size_t(std::max(m_, n_)), 1.0f);

    // The whole problem, then sub-blocks starting at tile boundaries.
    std::vector<Block> blocks{{0, m_, 0, n_}};
    if (offsets_) add_offset_blocks(kern, m_, n_, rng, &blocks);
    for (const Block& blk : blocks) {
      SCOPED_TRACE(testing::Message() << "block rows [" << blk.m0 << ", " << blk.m0 + blk.mc
                                      << ") cols [" << blk.n0 << ", " << blk.n0 + blk.nc << ")");
      const uint8_t* lp = lhs.data() + kern.lhs_packed_offset(blk.m0, k_);
      const uint8_t* rp = rhs.data() + kern.rhs_packed_offset(blk.n0, k_);

      // Unit scales first: dst = float(C), so the int32 sums themselves are compared (exactly
      // while |C| <= 2^24, which random data at these depths keeps), then random scales without
      // and with bias: the documented epilogue, bit for bit.
      for (Epilogue kind : {Epilogue::kUnit, Epilogue::kScaled, Epilogue::kScaledBias,
                            Epilogue::kStreamed}) {
        const bool unit = kind == Epilogue::kUnit, with_bias = kind >= Epilogue::kScaledBias;
        SCOPED_TRACE(unit ? "f32 with unit scales (the int32 sums)"
                          : kind == Epilogue::kStreamed ? "f32 with bias, stream_dst (same values)"
                          : with_bias ? "f32 with bias" : "f32 without bias");
        const cpumoe::QGemmEpilogue ep{unit ? ones.data() : ls.data() + blk.m0,
                                       unit ? ones.data() : rs.data() + blk.n0,
                                       with_bias ? bias.data() + blk.n0 : nullptr,
                                       kind == Epilogue::kStreamed};
        // One extra row so a write past the last row shows up too.
        // 64-byte aligned, so with a row stride of a multiple of 16 the streamed lines are whole.
        std::vector<float> df_store(size_t((m_ + 1) * ldd) + 16, kSentinelF32);
        float* df = df_store.data() + (16 - (reinterpret_cast<uintptr_t>(df_store.data()) / 4) % 16) % 16;
        kern.run_f32(blk.mc, blk.nc, k_, lp, rp, df + blk.m0 * ldd + blk.n0, ldd, ep);
        for (int64_t i = 0; i <= m_; ++i) {
          for (int64_t j = 0; j < ldd; ++j) {
            const float got = df[size_t(i * ldd + j)];
            float want = kSentinelF32;
            if (blk.contains(i, j)) {
              // The documented epilogue, in this order, in fp32 (the build disables contraction).
              want = float(ref[size_t(i * n_ + j)]) * (unit ? 1.0f : ls[size_t(i)]);
              want = want * (unit ? 1.0f : rs[size_t(j)]);
              if (with_bias) want = want + bias[size_t(j)];
            }
            ASSERT_EQ(std::memcmp(&got, &want, 4), 0)
                << "f32 at [" << i << "][" << j << "]: got " << got << " want " << want;
          }
        }
      }
    }
  }

 private:
  enum class Epilogue { kUnit, kScaled, kScaledBias, kStreamed };
  static constexpr float kSentinelF32 = -12345.678f;

  void fill(std::vector<int8_t>& v, int lo, int hi, int8_t c, std::mt19937& rng) const {
    std::uniform_int_distribution<int> d(lo, hi);
    for (auto& x : v) x = const_ ? c : int8_t(d(rng));
    // Row padding of a constant matrix gets garbage too: the packers must not read it.
    if (const_ && pad_ > 0)
      for (size_t i = 0; i < v.size(); ++i)
        if (int64_t(i) % (k_ + pad_) >= k_) v[i] = int8_t(d(rng));
  }

  int64_t m_ = 1, n_ = 1, k_ = 1, pad_ = 5, dst_pad_ = 3;
  bool const_ = false, offsets_ = true;
  int8_t ca_ = 0, cb_ = 0;
  uint32_t seed_ = 42;
};

}  // namespace cpumoe_test
