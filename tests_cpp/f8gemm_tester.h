/// @file f8gemm_tester.h
/// A builder-style tester for one F8GemmUkernel (the W8A16 FP8 family), as Q4GemmTester:
///   F8GemmTester().m(7).n(17).k(136).group(32).block_n(3).Test(kernel);
/// Random bf16 rows of A (through row pointers, row stride beyond k), random E4M3 codes (every
/// non-NaN code appears once n * k >= 254: subnormals, +-0 and +-448 included; row stride beyond
/// k, the padding NaN codes and garbage) and fp32 block scales (row stride beyond the group
/// count, the padding NaN), packed by the kernel's own packers, run whole (without bias, with
/// bias, with bias and stream_dst) and at m / n offsets at multiples of mr / nr.
///
/// The whole call is compared with the naive oracle (reference/gemm_f8): within the fp32 bound
/// (kernels sum a group in an order of their own, see kTolerance below), or bit for bit with
/// exact(): then every group sum is exact in fp32 in any order, so each kernel must give the
/// oracle's values. The calls at offsets must give the whole call's bits (the dispatcher splits a
/// GEMM into tasks by the thread count; the op is deterministic only if that changes nothing).
/// Also checks the packed sizes' guard zones, that a call stays inside the scratch_bytes it is
/// given (exactly that many bytes, starting as garbage), and that nothing outside the
/// destination block is written.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpumoe/dtype.h"
#include "cpumoe/f8gemm.h"
#include "qgemm_tester.h"  // GuardedBuffer, Block, add_offset_blocks
#include "reference/reference.h"

namespace cpumoe_test {

/// The non-NaN E4M3 codes (all 254), or with @p small_only those of |value| < 4 (exponent field
/// at most 8: 144 codes, subnormals and +-0 among them).
inline std::vector<uint8_t> e4m3_codes(bool small_only) {
  std::vector<uint8_t> v;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    if (small_only && ((c >> 3) & 15) > 8) continue;
    v.push_back(uint8_t(c));
  }
  return v;
}

class F8GemmTester {
 public:
  F8GemmTester& m(int64_t v) { m_ = v; return *this; }
  F8GemmTester& n(int64_t v) { n_ = v; return *this; }
  F8GemmTester& k(int64_t v) { k_ = v; return *this; }
  /// F8Layout::group: a multiple of kF8GroupMultiple, or >= k.
  F8GemmTester& group(int64_t v) { w_.group = v; return *this; }
  /// F8Layout::block_n: >= 1.
  F8GemmTester& block_n(int64_t v) { w_.block_n = v; return *this; }
  /// Scales at their extremes in some blocks: 1e-30, 1e30 and 0 (and negative ones).
  F8GemmTester& extreme_scales(bool v) { extreme_ = v; return *this; }
  /// A small integers in [-2, 2] and codes of |value| < 4 only: every group sum is a multiple of
  /// 2^-9 below 2^15 in magnitude, exact in fp32 in any order, so the result must be the
  /// oracle's bit for bit (needs groups below 4369 k).
  F8GemmTester& exact(bool v) { exact_ = v; return *this; }
  /// 4-bit codes (F8Layout::code_bits 4): indices into a random codebook of 16 distinct codes
  /// (one of them a zero); the kernel must have F8GemmUkernel::codes4. The whole call must also
  /// give, bit for bit, what the same weights packed as 8-bit codes give.
  F8GemmTester& codes4(bool v) { codes4_ = v; return *this; }
  /// Also call the kernel on sub-blocks at m / n offsets.
  F8GemmTester& offsets(bool v) { offsets_ = v; return *this; }
  F8GemmTester& seed(uint32_t v) { seed_ = v; return *this; }

  void Test(const cpumoe::F8GemmUkernel& kern) const {
    SCOPED_TRACE(testing::Message() << kern.name << " m=" << m_ << " n=" << n_ << " k=" << k_
                                    << " group=" << w_.group << " block_n=" << w_.block_n
                                    << (exact_ ? " exact" : " reals")
                                    << (codes4_ ? " 4-bit codes" : "")
                                    << (extreme_ ? " extreme scales" : ""));
    ASSERT_GE(k_, 1) << "bad test shape";
    ASSERT_TRUE(w_.group >= k_ || (w_.group > 0 && w_.group % cpumoe::kF8GroupMultiple == 0))
        << "bad test group";
    ASSERT_GE(w_.block_n, 1) << "bad test block_n";
    std::mt19937 rng(seed_ ^ uint32_t(m_ * 7919 + n_ * 104729 + k_ * 31 + w_.group * 17 +
                                      w_.block_n));
    const int64_t groups = cpumoe::f8_groups(k_, w_), gk = w_.group >= k_ ? k_ : w_.group;
    if (exact_) {
      ASSERT_LT(double(gk) * 2 * 3.75, 32768.0) << "exact() needs a shorter group";
    }
    const int64_t lda = k_ + 5, ldc = k_ + 7, lds = groups + 3, ldd = n_ + 3;
    const int64_t scale_rows = (n_ + w_.block_n - 1) / w_.block_n;
    const float nan = std::numeric_limits<float>::quiet_NaN();

    // A: bf16 rows, the row padding NaN (a packer that reads it poisons the result).
    std::vector<uint16_t> a_store(size_t(m_ * lda), 0x7fc1);
    for (int64_t i = 0; i < m_; ++i)
      for (int64_t x = 0; x < k_; ++x) a_store[size_t(i * lda + x)] = draw_a(rng);
    std::vector<const uint16_t*> rows(static_cast<size_t>(m_));
    std::vector<uint16_t> a(size_t(m_ * k_));
    for (int64_t i = 0; i < m_; ++i) {
      rows[size_t(i)] = a_store.data() + (m_ - 1 - i) * lda;  // pack_lhs follows the pointers
      std::memcpy(a.data() + i * k_, rows[size_t(i)], size_t(k_) * 2);
    }
    // Codes: shuffled runs of every allowed code, so all of them appear once n * k allows; the
    // row padding NaN codes and random bytes.
    const std::vector<uint8_t> allowed = e4m3_codes(exact_);
    std::vector<uint8_t> run = allowed, codes(size_t(n_ * ldc));
    size_t used = run.size();
    for (int64_t j = 0; j < n_; ++j) {
      for (int64_t x = 0; x < ldc; ++x) {
        uint8_t& c = codes[size_t(j * ldc + x)];
        if (x >= k_) {
          c = x % 2 ? uint8_t(0x7F | (rng() & 0x80)) : uint8_t(rng());
          continue;
        }
        if (used == run.size()) {
          std::shuffle(run.begin(), run.end(), rng);
          used = 0;
        }
        c = run[used++];
      }
    }
    // Scales: one per (block of block_n columns, group); the row padding NaN.
    std::vector<float> scales(size_t(std::max<int64_t>(scale_rows, 1) * lds), nan);
    std::uniform_real_distribution<float> ds(1.0f / 1024, 4.0f);
    for (int64_t r = 0; r < scale_rows; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        float v = ds(rng) * (rng() % 8 == 0 ? -1.0f : 1.0f);
        if (extreme_) {
          const int pick = int(rng() % 12);
          v = pick < 2 ? 1e-30f : pick < 4 ? 1e30f : pick == 4 ? 0.0f : pick == 5 ? -1e30f : v;
        }
        scales[size_t(r * lds + g)] = v;
      }
    }
    // 4-bit codes: the weights become codebook[index] (the oracle's codes); `packed_codes` is
    // what the kernel packs (indices, the row padding random bytes).
    cpumoe::F8Layout wk = w_;
    std::vector<uint8_t> packed_codes = codes;
    if (codes4_) {
      ASSERT_TRUE(kern.codes4) << "codes4() on a kernel without 4-bit codes";
      std::vector<uint8_t> pool = allowed;
      std::shuffle(pool.begin(), pool.end(), rng);
      pool.erase(std::remove_if(pool.begin(), pool.end(), [](uint8_t c) { return (c & 0x7F) == 0; }),
                 pool.end());
      wk.code_bits = 4;
      for (int i = 0; i < 16; ++i) wk.codebook[size_t(i)] = pool[size_t(i)];
      wk.codebook[rng() % 16] = uint8_t(rng() % 2 ? 0x80 : 0x00);  // the padding's zero
      for (int64_t j = 0; j < n_; ++j)
        for (int64_t x = 0; x < k_; ++x) {
          const uint8_t idx = uint8_t(rng() % 16);
          packed_codes[size_t(j * ldc + x)] = idx;
          codes[size_t(j * ldc + x)] = wk.codebook[idx];
        }
    }
    std::vector<float> bias(static_cast<size_t>(n_));
    std::uniform_real_distribution<float> db(-5.0f, 5.0f);
    for (auto& v : bias) v = exact_ ? float(int(db(rng))) : db(rng);

    std::vector<float> want_nb(size_t(m_ * n_)), want_b(size_t(m_ * n_));
    std::vector<double> mag(size_t(m_ * n_));
    cpumoe_ref::gemm_f8(m_, n_, k_, w_.group, w_.block_n, a.data(), k_, codes.data(), ldc,
                        scales.data(), lds, nullptr, want_nb.data(), n_, mag.data());
    cpumoe_ref::gemm_f8(m_, n_, k_, w_.group, w_.block_n, a.data(), k_, codes.data(), ldc,
                        scales.data(), lds, bias.data(), want_b.data(), n_);

    const size_t lhs_size = kern.lhs_packed_size(m_, k_);
    const size_t rhs_size = kern.rhs_packed_size(n_, k_, wk);
    GuardedBuffer lhs(lhs_size), rhs(rhs_size);
    kern.pack_lhs(m_, k_, rows.data(), lhs.data());
    kern.pack_rhs(n_, k_, wk, packed_codes.data(), ldc, scales.data(), lds, rhs.data());
    ASSERT_TRUE(lhs.guard_intact()) << "pack_lhs wrote past lhs_packed_size";
    ASSERT_TRUE(rhs.guard_intact()) << "pack_rhs wrote past rhs_packed_size";

    // Tolerance against the oracle (reals): a group of L products summed in fp32 in any order is
    // within (L - 1) u sum|p| of the exact sum (u = 2^-24), the oracle's S within u |S|; each
    // group's scaling and accumulation rounds once more on each side (at most 2 u times the
    // magnitudes mag sums), the bias once: (L + 2 G + 4) u (mag + |bias|) holds them with room
    // for the second-order terms. The absolute term covers results in the subnormal range.
    const int64_t lmax = cpumoe::round_up(gk, kern.kr);
    const double rel = double(lmax + 2 * groups + 4) * std::ldexp(1.0, -24);
    const double abs_tol = double(groups + 2) * double(std::numeric_limits<float>::denorm_min());

    // The whole call's results (without bias, with bias), which the calls at offsets must give.
    std::vector<float> whole[2] = {std::vector<float>(size_t(m_ * n_)),
                                   std::vector<float>(size_t(m_ * n_))};
    std::vector<Block> blocks{{0, m_, 0, n_}};
    if (offsets_ && m_ > 0 && n_ > 0) add_offset_blocks(kern, m_, n_, rng, &blocks);
    for (size_t bi = 0; bi < blocks.size(); ++bi) {
      const Block& blk = blocks[bi];
      SCOPED_TRACE(testing::Message() << "block rows [" << blk.m0 << ", " << blk.m0 + blk.mc
                                      << ") cols [" << blk.n0 << ", " << blk.n0 + blk.nc << ")");
      if (blk.n0 > 0) {
        ASSERT_EQ(kern.rhs_packed_offset(blk.n0, k_, wk) % 64, 0u);
      }
      const uint8_t* lp = lhs.data() + kern.lhs_packed_offset(blk.m0, k_);
      const uint8_t* rp = rhs.data() + kern.rhs_packed_offset(blk.n0, k_, wk);
      for (int kind = 0; kind < 3; ++kind) {  // no bias, bias, bias + stream_dst
        const bool with_bias = kind >= 1;
        SCOPED_TRACE(kind == 0 ? "without bias" : kind == 1 ? "with bias" : "stream_dst");
        // The call's scratch as the dispatcher plans it: scratch_bytes of this shape, 64-byte
        // aligned, starting as garbage (GuardedBuffer's pattern); none when that is 0.
        const size_t sbytes = kern.scratch_bytes(blk.mc, blk.nc, k_, wk);
        ASSERT_LE(sbytes, kern.scratch_bytes(m_, n_, k_, wk)) << "scratch_bytes not monotone";
        GuardedBuffer scratch(sbytes);
        cpumoe::F8GemmEpilogue ep;
        ep.bias = with_bias ? bias.data() + blk.n0 : nullptr;
        ep.stream_dst = kind == 2;
        ep.scratch = sbytes > 0 ? scratch.data() : nullptr;
        // One extra row so a write past the last row shows up too; 64-byte aligned.
        std::vector<float> df_store(size_t((m_ + 1) * ldd) + 16, kSentinel);
        float* df = df_store.data() +
                    (16 - (reinterpret_cast<uintptr_t>(df_store.data()) / 4) % 16) % 16;
        kern.run_f32(blk.mc, blk.nc, k_, wk, lp, rp, df + blk.m0 * ldd + blk.n0, ldd, ep);
        ASSERT_TRUE(scratch.guard_intact()) << "run_f32 wrote past scratch_bytes";
        const bool first = bi == 0 && kind < 2;  // the whole call: against the oracle
        std::vector<float>& mine = whole[with_bias ? 1 : 0];
        const std::vector<float>& want = with_bias ? want_b : want_nb;
        for (int64_t i = 0; i <= m_; ++i) {
          for (int64_t j = 0; j < ldd; ++j) {
            const float got = df[size_t(i * ldd + j)];
            if (!blk.contains(i, j)) {
              ASSERT_EQ(std::memcmp(&got, &kSentinel, 4), 0)
                  << "wrote outside the block at [" << i << "][" << j << "]: " << got;
              continue;
            }
            const size_t at = size_t(i * n_ + j);
            if (!first) {
              ASSERT_EQ(std::memcmp(&got, &mine[at], 4), 0)
                  << "at [" << i << "][" << j << "]: got " << got << ", the whole call "
                  << mine[at] << " (not bit-identical)";
              continue;
            }
            mine[at] = got;
            const float w = want[at];
            ASSERT_FALSE(std::isnan(w)) << "the oracle gave NaN at [" << i << "][" << j << "]";
            if (exact_) {
              ASSERT_EQ(got, w) << "at [" << i << "][" << j << "] (exact sums)";
            } else {
              const double tol = rel * (mag[at] + (with_bias ? std::fabs(double(bias[size_t(j)]))
                                                             : 0.0)) + abs_tol;
              ASSERT_LE(std::fabs(double(got) - double(w)), tol)
                  << "at [" << i << "][" << j << "]: got " << got << " want " << w
                  << " (tolerance " << tol << ")";
            }
          }
        }
      }
    }
    if (codes4_ && m_ > 0 && n_ > 0) {  // the same weights as 8-bit codes: the same bits
      SCOPED_TRACE("8-bit codes of the same weights");
      GuardedBuffer rhs8(kern.rhs_packed_size(n_, k_, w_));
      kern.pack_rhs(n_, k_, w_, codes.data(), ldc, scales.data(), lds, rhs8.data());
      ASSERT_LE(rhs_size, kern.rhs_packed_size(n_, k_, w_)) << "4-bit codes packed larger";
      if (k_ >= 128) {  // beyond the 64-byte padding of a block
        ASSERT_LT(rhs_size, kern.rhs_packed_size(n_, k_, w_)) << "4-bit codes packed no smaller";
      }
      GuardedBuffer scratch(kern.scratch_bytes(m_, n_, k_, w_));
      cpumoe::F8GemmEpilogue ep;
      ep.scratch = scratch.data();
      std::vector<float> d8(size_t(m_ * n_));
      kern.run_f32(m_, n_, k_, w_, lhs.data(), rhs8.data(), d8.data(), n_, ep);
      for (size_t at = 0; at < d8.size(); ++at)
        ASSERT_EQ(std::memcmp(&d8[at], &whole[0][at], 4), 0)
            << "at " << at << ": 8-bit codes " << d8[at] << ", 4-bit " << whole[0][at];
    }
  }

 private:
  static constexpr float kSentinel = -12345.678f;

  // Reals: +-(1 + m / 128) 2^e, e in [-6, 3] (normal bf16: the hardware paths may flush
  // subnormal ones), 1 in 16 a zero of either sign. exact(): integers in [-2, 2].
  uint16_t draw_a(std::mt19937& rng) const {
    if (exact_) return cpumoe::f32_to_bf16(float(int(rng() % 5) - 2));
    const uint32_t r = rng();
    if (r % 16 == 0) return uint16_t(r & 0x8000);
    const float v = std::ldexp(1.0f + float((r >> 4) & 127) / 128.0f, int((r >> 11) % 10) - 6);
    return cpumoe::f32_to_bf16((r >> 20) & 1 ? -v : v);
  }

  cpumoe::F8Layout w_{};
  int64_t m_ = 1, n_ = 1, k_ = 32;
  bool extreme_ = false, exact_ = false, offsets_ = true, codes4_ = false;
  uint32_t seed_ = 42;
};

}  // namespace cpumoe_test
