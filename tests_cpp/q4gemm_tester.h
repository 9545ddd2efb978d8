/// @file q4gemm_tester.h
/// A builder-style tester for one Q4GemmUkernel (the W4A8 family), as QGemmTester:
///   Q4GemmTester().format(W4Format::int4).group(64).m(7).n(17).k(128).Test(kernel);
/// Random int8 rows of A (through row pointers), random 4-bit (int8_affine: 8-bit) codes and
/// group scales of B (row strides beyond k and k / group), packed by the kernel's own packers,
/// run whole and at m / n offsets at multiples of mr / nr, compared with the naive oracle
/// (reference/gemm_w4_kernel) bit for bit (a NaN where the oracle has one). Checks the packed
/// sizes' guard zones, that a call stays inside the scratch_bytes (pack_rhs: pack_scratch_bytes)
/// it is given, and that nothing outside the destination block is written.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cpumoe/q4gemm.h"
#include "qgemm_tester.h"  // GuardedBuffer, Block, add_offset_blocks
#include "reference/reference.h"

namespace cpumoe_test {

class Q4GemmTester {
 public:
  Q4GemmTester& m(int64_t v) { m_ = v; return *this; }
  Q4GemmTester& n(int64_t v) { n_ = v; return *this; }
  Q4GemmTester& k(int64_t v) { k_ = v; return *this; }
  Q4GemmTester& format(cpumoe::W4Format f) { w_.format = f; return *this; }
  Q4GemmTester& group(int64_t g) { w_.group = g; return *this; }
  /// Scales at their extremes: int4 tiny and huge positive values; mxfp4 E8M0 0, 1, 254 and
  /// 255 (NaN) in some groups.
  Q4GemmTester& extreme_scales(bool v) { extreme_ = v; return *this; }
  /// Every code c and A all `a` (the int32-range test at the largest |value|).
  /// W4Format::int8_affine: the kernel's 8-bit codes (value c - 128), for kernels with codes8.
  Q4GemmTester& constant(int8_t a, uint8_t c) { const_ = true; ca_ = a; cc_ = c; return *this; }
  Q4GemmTester& offsets(bool v) { offsets_ = v; return *this; }
  /// Activations quantized per group: an lhs_group_scale per row and group (random, with
  /// tiny and huge values among them), beside the row scales.
  Q4GemmTester& group_scales(bool v) { gscale_ = v; return *this; }
  Q4GemmTester& seed(uint32_t v) { seed_ = v; return *this; }

  void Test(const cpumoe::Q4GemmUkernel& kern) const {
    using cpumoe::W4Format;
    const bool mx = w_.format == W4Format::mxfp4;
    SCOPED_TRACE(testing::Message() << kern.name << " " << cpumoe::w4_format_name(w_.format)
                                    << (gscale_ ? " group scales" : "") << " g=" << w_.group << " m=" << m_ << " n=" << n_
                                    << " k=" << k_);
    ASSERT_EQ(k_ % w_.group, 0) << "bad test shape";
    std::mt19937 rng(seed_ ^ uint32_t(m_ * 7919 + n_ * 104729 + k_ * 31 + w_.group));
    const int64_t groups = k_ / w_.group, sb = w_.scale_bytes();
    const int64_t lda = k_ + 5, ldc = k_ + 7, lds = groups + 3, ldd = n_ + 3;

    std::vector<int8_t> a_store(size_t(m_ * lda));
    std::vector<uint8_t> codes(size_t(n_ * ldc));
    const bool bytes = w_.format == W4Format::int8_affine;
    std::uniform_int_distribution<int> da(-127, 127), dc(0, bytes ? 255 : 15);
    for (auto& v : a_store) v = const_ ? ca_ : int8_t(da(rng));
    for (size_t i = 0; i < codes.size(); ++i)
      codes[i] = const_ && int64_t(i) % ldc < k_ ? cc_
                 : uint8_t(dc(rng) | (bytes ? 0 : int(rng() % 16) << 4));
    // Garbage in the code padding and (4-bit codes) the high nibbles: the packer must mask and
    // skip them.
    for (size_t i = 0; i < codes.size(); ++i)
      if (int64_t(i) % ldc >= k_) codes[i] = uint8_t(rng());
    std::vector<uint8_t> scales(size_t(n_ * lds * sb), 0x7f);
    std::uniform_real_distribution<float> ds(1e-3f, 2.0f);
    std::uniform_int_distribution<int> de(110, 135);
    for (int64_t j = 0; j < n_; ++j) {
      for (int64_t gi = 0; gi < groups; ++gi) {
        uint8_t* s = scales.data() + (j * lds + gi) * sb;
        if (mx) {
          int e = de(rng);
          if (extreme_) {
            const int pick = int(rng() % 8);
            e = pick == 0 ? 0 : pick == 1 ? 1 : pick == 2 ? 254 : pick == 3 ? 255 : e;
          }
          *s = uint8_t(e);
        } else {
          float v = ds(rng);
          if (extreme_) {
            // int4 scales may be negative or zero (GGUF's Q4_0 stores both).
            const int pick = int(rng() % 8);
            v = pick == 0 ? 1e-30f : pick == 1 ? 1e30f : pick == 2 ? -v : pick == 3 ? 0.0f
                : pick == 4 ? -1e30f : v;
          }
          std::memcpy(s, &v, 4);
        }
      }
    }
    std::vector<const int8_t*> rows(static_cast<size_t>(m_));
    std::vector<int8_t> a(size_t(m_ * k_));
    for (int64_t i = 0; i < m_; ++i) {
      rows[size_t(i)] = a_store.data() + (m_ - 1 - i) * lda;  // pack_lhs follows the pointers
      std::memcpy(a.data() + i * k_, rows[size_t(i)], size_t(k_));
    }

    const size_t lhs_size = kern.lhs_packed_size(m_, k_);
    const size_t rhs_size = kern.rhs_packed_size(n_, k_, w_);
    GuardedBuffer lhs(lhs_size), rhs(rhs_size);
    kern.pack_lhs(m_, k_, rows.data(), lhs.data());
    // The packer's scratch as PackedExperts plans it: pack_scratch_bytes of this call, 64-byte
    // aligned, starting as garbage (GuardedBuffer's pattern); none when that is 0.
    const size_t pbytes = kern.pack_scratch_bytes(n_, k_, w_);
    GuardedBuffer pscratch(pbytes);
    kern.pack_rhs(n_, k_, w_, codes.data(), ldc, scales.data(), lds, rhs.data(),
                  pbytes > 0 ? pscratch.data() : nullptr);
    ASSERT_TRUE(lhs.guard_intact()) << "pack_lhs wrote past lhs_packed_size";
    ASSERT_TRUE(rhs.guard_intact()) << "pack_rhs wrote past rhs_packed_size";
    ASSERT_TRUE(pscratch.guard_intact()) << "pack_rhs wrote past pack_scratch_bytes";

    std::vector<float> ls(static_cast<size_t>(m_)), bias(static_cast<size_t>(n_));
    std::uniform_real_distribution<float> dl(1e-4f, 2.0f), db(-5.0f, 5.0f);
    for (auto& v : ls) v = dl(rng);
    for (auto& v : bias) v = db(rng);
    std::vector<float> gs(gscale_ ? size_t(m_ * groups) : 0);
    for (size_t i = 0; i < gs.size(); ++i) {
      const int pick = int(rng() % 16);
      gs[i] = pick == 0 ? 1e-30f : pick == 1 ? 1e30f : dl(rng);
    }
    const float* gsp = gscale_ ? gs.data() : nullptr;
    std::vector<float> want_nb(size_t(m_ * n_)), want_b(size_t(m_ * n_));
    cpumoe_ref::gemm_w4_kernel(m_, n_, k_, w_.format, w_.group, a.data(), k_, codes.data(), ldc,
                               scales.data(), lds, ls.data(), nullptr, want_nb.data(), n_, gsp);
    cpumoe_ref::gemm_w4_kernel(m_, n_, k_, w_.format, w_.group, a.data(), k_, codes.data(), ldc,
                               scales.data(), lds, ls.data(), bias.data(), want_b.data(), n_, gsp);

    std::vector<Block> blocks{{0, m_, 0, n_}};
    if (offsets_) add_offset_blocks(kern, m_, n_, rng, &blocks);
    for (const Block& blk : blocks) {
      SCOPED_TRACE(testing::Message() << "block rows [" << blk.m0 << ", " << blk.m0 + blk.mc
                                      << ") cols [" << blk.n0 << ", " << blk.n0 + blk.nc << ")");
      const uint8_t* lp = lhs.data() + kern.lhs_packed_offset(blk.m0, k_);
      const uint8_t* rp = rhs.data() + kern.rhs_packed_offset(blk.n0, k_, w_);
      for (int kind = 0; kind < 3; ++kind) {  // no bias, bias, bias + stream_dst
        const bool with_bias = kind >= 1;
        SCOPED_TRACE(kind == 0 ? "without bias" : kind == 1 ? "with bias" : "stream_dst");
        // The call's scratch as the dispatcher plans it: scratch_bytes of this shape, 64-byte
        // aligned, starting as garbage (GuardedBuffer's pattern); none when that is 0.
        const size_t sbytes = kern.scratch_bytes(blk.mc, blk.nc, k_, w_);
        ASSERT_LE(sbytes, kern.scratch_bytes(m_, n_, k_, w_)) << "scratch_bytes not monotone";
        GuardedBuffer scratch(sbytes);
        const cpumoe::Q4GemmEpilogue ep{ls.data() + blk.m0,
                                        with_bias ? bias.data() + blk.n0 : nullptr, kind == 2,
                                        sbytes > 0 ? scratch.data() : nullptr,
                                        gscale_ ? gs.data() + blk.m0 * groups : nullptr};
        std::vector<float> df_store(size_t((m_ + 1) * ldd) + 16, kSentinel);
        float* df = df_store.data() +
                    (16 - (reinterpret_cast<uintptr_t>(df_store.data()) / 4) % 16) % 16;
        kern.run_f32(blk.mc, blk.nc, k_, w_, lp, rp, df + blk.m0 * ldd + blk.n0, ldd, ep);
        ASSERT_TRUE(scratch.guard_intact()) << "run_f32 wrote past scratch_bytes";
        const std::vector<float>& want = with_bias ? want_b : want_nb;
        for (int64_t i = 0; i <= m_; ++i) {
          for (int64_t j = 0; j < ldd; ++j) {
            const float got = df[size_t(i * ldd + j)];
            const float w = blk.contains(i, j) ? want[size_t(i * n_ + j)] : kSentinel;
            if (std::isnan(w)) {
              ASSERT_TRUE(std::isnan(got)) << "at [" << i << "][" << j << "]: got " << got;
            } else {
              ASSERT_EQ(std::memcmp(&got, &w, 4), 0)
                  << "at [" << i << "][" << j << "]: got " << got << " want " << w;
            }
          }
        }
      }
    }
  }

 private:
  static constexpr float kSentinel = -12345.678f;
  cpumoe::W4Layout w_{};
  int64_t m_ = 1, n_ = 1, k_ = 32;
  bool extreme_ = false, const_ = false, offsets_ = true, gscale_ = false;
  int8_t ca_ = 0;
  uint8_t cc_ = 0;
  uint32_t seed_ = 42;
};

}  // namespace cpumoe_test
