/// @file bgemm_tester.h
/// A builder-style tester for one BGemmUkernel (the bf16 -> fp32 family), as QGemmTester is for
/// the int8 one:
///   BGemmTester().m(7).n(17).k(72).Test(kernel);
/// It packs random bf16 operands through the kernel's packers (row pointers for A in reverse
/// order, a row stride > k for B), runs run_f32 with and without bias over the whole problem and
/// at m / n offsets taken at multiples of mr / nr, and checks every element against a naive
/// double-precision GEMM; nothing outside the destination block may be written, packing stays
/// inside the packed size.
///
/// Two kinds of data: `integers()` (the default) draws small integers, whose products and sums
/// are exact in fp32 in any order, so every kernel must match the oracle exactly; `reals()` draws
/// general bf16 values and allows the fp32 summation error bound (k + 2) * 2^-24 * sum |a b|.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cpumoe/bgemm.h"
#include "cpumoe/dtype.h"
#include "qgemm_tester.h"  // GuardedBuffer, Block, add_offset_blocks

namespace cpumoe_test {

class BGemmTester {
 public:
  BGemmTester& m(int64_t v) { m_ = v; return *this; }
  BGemmTester& n(int64_t v) { n_ = v; return *this; }
  BGemmTester& k(int64_t v) { k_ = v; return *this; }
  BGemmTester& row_padding(int64_t v) { pad_ = v; return *this; }
  BGemmTester& dst_padding(int64_t v) { dst_pad_ = v; return *this; }
  /// Values in [-lim, lim] integers (exact sums while k * lim^2 < 2^24).
  BGemmTester& integers(int lim = 8) { reals_ = false; lim_ = lim; return *this; }
  BGemmTester& reals() { reals_ = true; return *this; }
  BGemmTester& offsets(bool v) { offsets_ = v; return *this; }
  BGemmTester& seed(uint32_t v) { seed_ = v; return *this; }

  void Test(const cpumoe::BGemmUkernel& kern) const {
    SCOPED_TRACE(testing::Message() << kern.name << " m=" << m_ << " n=" << n_ << " k=" << k_
                                    << (reals_ ? " reals" : " integers"));
    std::mt19937 rng(seed_ ^ uint32_t(m_ * 7919 + n_ * 104729 + k_));
    const int64_t lda = k_ + pad_, ldb = k_ + pad_, ldd = n_ + dst_pad_;
    std::vector<uint16_t> a_store(size_t(m_ * lda)), b(size_t(n_ * ldb));
    fill(a_store, rng);
    fill(b, rng);
    std::vector<const uint16_t*> rows(static_cast<size_t>(m_));
    for (int64_t i = 0; i < m_; ++i) rows[size_t(i)] = a_store.data() + (m_ - 1 - i) * lda;

    // The oracle in double, with the sum of |products| for the error bound.
    std::vector<double> ref(size_t(m_ * n_)), mag(size_t(m_ * n_));
    for (int64_t i = 0; i < m_; ++i)
      for (int64_t j = 0; j < n_; ++j) {
        double s = 0, sa = 0;
        for (int64_t x = 0; x < k_; ++x) {
          const double p = double(cpumoe::bf16_to_f32(rows[size_t(i)][x])) *
                           double(cpumoe::bf16_to_f32(b[size_t(j * ldb + x)]));
          s += p;
          sa += std::fabs(p);
        }
        ref[size_t(i * n_ + j)] = s;
        mag[size_t(i * n_ + j)] = sa;
      }

    GuardedBuffer lhs(kern.lhs_packed_size(m_, k_)), rhs(kern.rhs_packed_size(n_, k_));
    kern.pack_lhs(m_, k_, rows.data(), lhs.data());
    kern.pack_rhs(n_, k_, b.data(), ldb, rhs.data());
    ASSERT_TRUE(lhs.guard_intact()) << "pack_lhs wrote past lhs_packed_size";
    ASSERT_TRUE(rhs.guard_intact()) << "pack_rhs wrote past rhs_packed_size";

    std::vector<float> bias(static_cast<size_t>(n_));
    std::uniform_int_distribution<int> bd(-16, 16);
    for (auto& v : bias) v = float(bd(rng)) * (reals_ ? 0.37f : 1.0f);

    std::vector<Block> blocks{{0, m_, 0, n_}};
    if (offsets_) add_offset_blocks(kern, m_, n_, rng, &blocks);
    for (const Block& blk : blocks) {
      SCOPED_TRACE(testing::Message() << "block rows [" << blk.m0 << ", " << blk.m0 + blk.mc
                                      << ") cols [" << blk.n0 << ", " << blk.n0 + blk.nc << ")");
      const uint8_t* lp = lhs.data() + kern.lhs_packed_offset(blk.m0, k_);
      const uint8_t* rp = rhs.data() + kern.rhs_packed_offset(blk.n0, k_);
      for (bool with_bias : {false, true}) {
        SCOPED_TRACE(with_bias ? "with bias" : "without bias");
        std::vector<float> d(size_t((m_ + 1) * ldd), kSentinel);
        kern.run_f32(blk.mc, blk.nc, k_, lp, rp, d.data() + blk.m0 * ldd + blk.n0, ldd,
                     with_bias ? bias.data() + blk.n0 : nullptr);
        for (int64_t i = 0; i <= m_; ++i) {
          for (int64_t j = 0; j < ldd; ++j) {
            const float got = d[size_t(i * ldd + j)];
            if (!blk.contains(i, j)) {
              ASSERT_EQ(std::memcmp(&got, &kSentinel, 4), 0)
                  << "wrote outside the block at [" << i << "][" << j << "]";
              continue;
            }
            const double b0 = with_bias ? double(bias[size_t(j)]) : 0.0;
            const double want = ref[size_t(i * n_ + j)] + b0;
            if (!reals_) {
              ASSERT_EQ(double(got), want) << "at [" << i << "][" << j << "]";
            } else {
              const double tol =
                  double(k_ + 2) * std::ldexp(1.0, -24) * (mag[size_t(i * n_ + j)] + std::fabs(b0)) +
                  1e-30;
              ASSERT_LE(std::fabs(double(got) - want), tol)
                  << "at [" << i << "][" << j << "]: got " << got << " want " << want;
            }
          }
        }
      }
    }
  }

 private:
  static constexpr float kSentinel = -12345.678f;


  // Row padding gets NaN bit patterns: a packer that reads past k poisons the result.
  void fill(std::vector<uint16_t>& v, std::mt19937& rng) const {
    std::uniform_int_distribution<int> di(-lim_, lim_);
    std::normal_distribution<float> dr(0.0f, 1.0f);
    for (size_t i = 0; i < v.size(); ++i) {
      if (int64_t(i) % (k_ + pad_) >= k_) {
        v[i] = 0x7fc1;
        continue;
      }
      v[i] = cpumoe::f32_to_bf16(reals_ ? dr(rng) : float(di(rng)));
    }
  }

  int64_t m_ = 1, n_ = 1, k_ = 1, pad_ = 5, dst_pad_ = 3;
  bool reals_ = false, offsets_ = true;
  int lim_ = 8;
  uint32_t seed_ = 1;
};

}  // namespace cpumoe_test
