// The row operations around the GEMMs (quantization, rounding to the dtype, stores, the fused
// activation rows, the weighted combine) give the bits of their scalar definitions, for every
// length (vector bodies and tails), dtype and special value, on every RowOps variant this CPU runs
// (quantize.h as built for the baseline: scalar on x86-64, NEON on AArch64; AVX-512) and in
// quantize.h's own forms; quantization also matches the oracle's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "../csrc/moe/combine.h"
#include "../csrc/ukernels/rowops/quantize.h"
#include "activation_specs.h"
#include "cpumoe/rowops.h"
#include "reference/reference.h"

namespace {

using cpumoe::DType;
using cpumoe::RowOps;
namespace rowops = cpumoe::rowops;

// One RowOps variant per test instance; variants the CPU cannot run are skipped.
class RowOpsTest : public testing::TestWithParam<const RowOps*> {
 protected:
  void SetUp() override {
    if (!cpumoe::cpu_supports(GetParam()->isa))
      GTEST_SKIP() << GetParam()->name << " needs " << cpumoe::isa_name(GetParam()->isa);
  }
  const RowOps& ops() const { return *GetParam(); }
};

constexpr DType kDtypes[] = {DType::f32, DType::bf16, DType::f16};
constexpr int64_t kLengths[] = {1, 3, 4, 7, 15, 16, 17, 31, 33, 64, 95, 768, 2048, 2880};

// The scalar definition (moe.h quantize_row), element by element.
float scalar_quantize(const std::vector<float>& x, int8_t* q) {
  float amax = 0.0f;
  for (float v : x) amax = rowops::amax_step(amax, std::fabs(v));
  const float s = std::max(amax, cpumoe::kAmaxFloor) / 127.0f;
  for (size_t i = 0; i < x.size(); ++i) q[i] = rowops::quantize_one(x[i], s);
  return s;
}

// A row in dtype dt (raw bytes) and its fp32 values.
struct Row {
  std::vector<uint8_t> bytes;
  std::vector<float> f32;
};
Row make_row(const std::vector<float>& v, DType dt) {
  Row r;
  r.bytes.resize(v.size() * size_t(cpumoe::dtype_size(dt)));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == DType::f32) {
      std::memcpy(&r.bytes[4 * i], &v[i], 4);
    } else {
      const uint16_t h = dt == DType::bf16 ? cpumoe::f32_to_bf16(v[i]) : cpumoe::f32_to_f16(v[i]);
      std::memcpy(&r.bytes[2 * i], &h, 2);
    }
    r.f32.push_back(cpumoe::load_as_f32(r.bytes.data(), dt, int64_t(i)));
  }
  return r;
}

void expect_same_quantization(const RowOps& ops, const std::vector<float>& v, DType dt) {
  const Row r = make_row(v, dt);
  const size_t n = v.size();
  std::vector<int8_t> got(n + 16, 99), want(n, 98), oracle(n, 97);
  const float s = ops.quantize(r.bytes.data(), dt, int64_t(n), got.data());
  for (size_t i = n; i < got.size(); ++i) ASSERT_EQ(got[i], 99) << "wrote past the row";
  const float ws = scalar_quantize(r.f32, want.data());
  const float os = cpumoe_ref::quantize_row(r.f32.data(), int64_t(n), oracle.data());
  ASSERT_EQ(std::isnan(s), std::isnan(ws));
  if (!std::isnan(s)) {
    ASSERT_EQ(std::memcmp(&s, &ws, 4), 0) << s << " vs " << ws;
  }
  ASSERT_EQ(std::isnan(s), std::isnan(os));
  if (!std::isnan(s)) {
    ASSERT_EQ(s, os);
  }
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(got[i], want[i]) << "i=" << i << " x=" << r.f32[i];
    ASSERT_EQ(got[i], oracle[i]) << "i=" << i << " x=" << r.f32[i];
  }
}

TEST_P(RowOpsTest, QuantizeMatchesScalarAndOracle) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (DType dt : kDtypes) {
    SCOPED_TRACE(cpumoe::dtype_name(dt));
    for (int64_t n : kLengths) {
      SCOPED_TRACE(testing::Message() << "n=" << n);
      std::vector<float> v(static_cast<size_t>(n));
      for (auto& x : v) x = nd(rng) * 3.0f;
      expect_same_quantization(ops(), v, dt);
      // Ties: amax 127 gives s = 1, so k + 0.5 lands exactly on a midpoint (both parities).
      for (size_t i = 0; i < v.size(); ++i) v[i] = float(int64_t(i % 254) - 127) + 0.5f;
      v[0] = 127.0f;
      expect_same_quantization(ops(), v, dt);
      // The amax floor (tiny row), all zeros, one huge value.
      for (auto& x : v) x = nd(rng) * 1e-9f;
      expect_same_quantization(ops(), v, dt);
      std::fill(v.begin(), v.end(), 0.0f);
      expect_same_quantization(ops(), v, dt);
      v[size_t(n - 1)] = -6e4f;
      expect_same_quantization(ops(), v, dt);
      // A NaN or an infinity at the first, a middle and the last position.
      for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity()}) {
        for (size_t at : {size_t(0), size_t(n / 2), size_t(n - 1)}) {
          for (auto& x : v) x = nd(rng);
          v[at] = bad;
          expect_same_quantization(ops(), v, dt);
        }
      }
    }
  }
}

// Bit patterns: random fp32 values over every exponent, plus every special class.
std::vector<float> bit_patterns(size_t random_count) {
  std::mt19937 rng(13);
  std::vector<float> v;
  for (size_t i = 0; i < random_count; ++i) v.push_back(cpumoe::f32_from_bits(uint32_t(rng())));
  for (uint32_t u : {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x7f800000u, 0xff800000u,
                     0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fbfffffu, 0x477fefffu, 0x477ff000u,
                     0x38800000u, 0x387fffffu, 0x33000000u, 0x33000001u, 0x3f808000u, 0x3f818000u,
                     0x7f7fffffu, 0xc77ff000u})
    v.push_back(cpumoe::f32_from_bits(u));
  // Every bf16 and f16 midpoint neighbourhood of a few binades.
  for (uint32_t e = 100; e < 150; e += 7)
    for (uint32_t m = 0; m < 64; ++m)
      for (uint32_t low : {0x0fffu, 0x1000u, 0x1001u, 0x7fffu, 0x8000u, 0x8001u})
        v.push_back(cpumoe::f32_from_bits((e << 23) | (m << 16) | low));
  return v;
}

// The dtype stores of every variant (the rounding the vector backends write themselves) on
// every bit pattern: a last combine pass of acc + 0 * 0, against the scalar pass's bits.
TEST_P(RowOpsTest, CombineStoreMatchesScalarOnEveryBitPattern) {
  const std::vector<float> v = bit_patterns(200000);
  for (DType dt : kDtypes) {
    SCOPED_TRACE(cpumoe::dtype_name(dt));
    for (size_t off : {size_t(0), size_t(1), size_t(3)}) {  // tails of every length
      std::vector<float> acc(v.begin() + long(off), v.end());
      const int64_t n = int64_t(acc.size());
      const std::vector<float> zeros(acc.size(), 0.0f);
      const float* ys[1] = {zeros.data()};
      const float ws[1] = {0.0f};
      std::vector<uint8_t> got(size_t(n) * 4, 0xa5), want(size_t(n) * 4, 0x5a);
      std::vector<float> acc2 = acc;
      GetParam()->weighted_sum_pass(1, ys, ws, n, false, true, dt, got.data(), acc.data());
      rowops::weighted_sum_pass(1, ys, ws, n, false, true, dt, want.data(), acc2.data());
      const size_t bytes = size_t(n) * size_t(cpumoe::dtype_size(dt));
      ASSERT_EQ(std::memcmp(got.data(), want.data(), bytes), 0);
    }
  }
}

TEST(Quantize, StoreRowMatchesScalarBitForBit) {
  const std::vector<float> v = bit_patterns(200000);
  for (DType dt : kDtypes) {
    SCOPED_TRACE(cpumoe::dtype_name(dt));
    for (size_t off : {size_t(0), size_t(1), size_t(3)}) {
      const int64_t n = int64_t(v.size() - off);
      std::vector<uint8_t> got(size_t(n) * 4 + 8, 0xa5);
      rowops::store_row(v.data() + off, n, dt, got.data());
      for (int64_t i = 0; i < n; ++i) {
        const float x = v[size_t(i) + off];
        if (dt == DType::f32) {
          ASSERT_EQ(std::memcmp(&got[size_t(i) * 4], &x, 4), 0);
          continue;
        }
        uint16_t h;
        std::memcpy(&h, &got[size_t(i) * 2], 2);
        const uint16_t want = dt == DType::bf16 ? cpumoe::f32_to_bf16(x) : cpumoe::f32_to_f16(x);
        ASSERT_EQ(h, want) << std::hex << "x bits 0x" << cpumoe::f32_bits(x);
      }
      const size_t end = size_t(n) * size_t(cpumoe::dtype_size(dt));
      for (size_t b = end; b < got.size(); ++b) ASSERT_EQ(got[b], 0xa5) << "wrote past the row";
    }
  }
}

// The fused activation row (activation, rounding to the dtype and the absolute maximum in one
// pass, then the quantization) against the three steps one after the other.
TEST_P(RowOpsTest, ActivateRoundMatchesTheSteps) {
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  const std::vector<float> patterns = bit_patterns(4000);
  for (const cpumoe::ActivationSpec& act : cpumoe_test::activation_specs()) {
    for (DType dt : kDtypes) {
      for (int64_t inter : {1, 3, 4, 7, 8, 13, 16, 24, 768}) {
        SCOPED_TRACE(testing::Message() << cpumoe_test::spec_name(act) << " "
                                        << cpumoe::dtype_name(dt) << " I=" << inter);
        for (int variant = 0; variant < 4; ++variant) {
          std::vector<float> row(size_t(2 * inter));
          for (auto& v : row) v = nd(rng);
          if (variant == 1) row[size_t(inter / 2)] = std::numeric_limits<float>::quiet_NaN();
          if (variant == 2) std::fill(row.begin(), row.end(), 0.0f);
          if (variant == 3)  // every exponent, infinities and NaNs: the clamps and NaN rules
            for (size_t i = 0; i < row.size(); ++i) row[i] = patterns[(i * 7919 + 13 * size_t(inter)) % patterns.size()];
          std::vector<float> want_a(static_cast<size_t>(inter)), got_a(static_cast<size_t>(inter));
          std::vector<int8_t> want_q(static_cast<size_t>(inter)), got_q(static_cast<size_t>(inter));
          cpumoe::vec::gated_row(act, row.data(), inter, want_a.data());
          for (auto& v : want_a) v = cpumoe::round_to_dtype(v, dt);
          const float want_s = rowops::quantize_row_scalar(want_a.data(), DType::f32, inter, want_q.data());
          const float amax = ops().activate_round(act, row.data(), inter, dt, got_a.data());
          const float got_s = ops().quantize_with_amax(got_a.data(), inter, amax, got_q.data());
          ASSERT_EQ(std::isnan(got_s), std::isnan(want_s));
          if (!std::isnan(want_s)) {
            ASSERT_EQ(cpumoe::f32_bits(got_s), cpumoe::f32_bits(want_s));
          }
          for (int64_t i = 0; i < inter; ++i) {
            const float g = got_a[size_t(i)], w = want_a[size_t(i)];
            ASSERT_TRUE(std::isnan(g) ? std::isnan(w) : cpumoe::f32_bits(g) == cpumoe::f32_bits(w))
                << "i=" << i;
            ASSERT_EQ(got_q[size_t(i)], want_q[size_t(i)]) << "i=" << i;
          }
        }
      }
    }
  }
}

// The weighted combine against `acc = 0; acc[i] += w * y[i]` per slot, then the dtype store, for
// 0 to 19 slots (more than one pass of 8 in registers) with some slots absent.
TEST_P(RowOpsTest, WeightedSumRowMatchesTheLoop) {
  std::mt19937 rng(19);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (DType dt : kDtypes) {
    for (int64_t n : {1, 7, 8, 9, 33, 2048}) {
      for (int64_t count : {0, 1, 3, 8, 9, 19}) {
        SCOPED_TRACE(testing::Message() << cpumoe::dtype_name(dt) << " n=" << n << " k=" << count);
        std::vector<std::vector<float>> y(static_cast<size_t>(count));
        std::vector<float> w(static_cast<size_t>(count));
        std::vector<bool> present(static_cast<size_t>(count));
        for (int64_t j = 0; j < count; ++j) {
          y[size_t(j)].resize(static_cast<size_t>(n));
          for (auto& v : y[size_t(j)]) v = nd(rng);
          w[size_t(j)] = nd(rng);
          present[size_t(j)] = j % 4 != 2;
        }
        std::vector<float> acc(static_cast<size_t>(n), 0.0f), scratch(static_cast<size_t>(n));
        for (int64_t j = 0; j < count; ++j)
          if (present[size_t(j)])
            for (int64_t i = 0; i < n; ++i) acc[size_t(i)] += w[size_t(j)] * y[size_t(j)][size_t(i)];
        std::vector<uint8_t> want(size_t(n) * 4 + 4, 0), got(size_t(n) * 4 + 4, 0xa5);
        rowops::store_row(acc.data(), n, dt, want.data());
        auto slot = [&](int64_t j, const float** yr, float* wr) {
          if (!present[size_t(j)]) return false;
          *yr = y[size_t(j)].data();
          *wr = w[size_t(j)];
          return true;
        };
        cpumoe::moe_detail::weighted_sum_row(count, slot, n, dt, got.data(), scratch.data(),
                                             ops().weighted_sum_pass);
        const size_t bytes = size_t(n) * size_t(cpumoe::dtype_size(dt));
        ASSERT_EQ(std::memcmp(got.data(), want.data(), bytes), 0);
        for (size_t b = bytes; b < got.size(); ++b) ASSERT_EQ(got[b], 0xa5) << "wrote past the row";
      }
    }
  }
}

// The bf16 op's input rounding, over every bit pattern in each input dtype.
TEST_P(RowOpsTest, ToBf16MatchesScalarBitForBit) {
  const std::vector<float> v = bit_patterns(20000);
  for (DType dt : kDtypes) {
    SCOPED_TRACE(cpumoe::dtype_name(dt));
    const Row r = make_row(v, dt);
    for (size_t off : {size_t(0), size_t(1), size_t(5)}) {
      const int64_t n = int64_t(v.size() - off);
      std::vector<uint16_t> got(size_t(n) + 16, 0xa5a5);
      ops().to_bf16(r.bytes.data() + off * size_t(cpumoe::dtype_size(dt)), dt, n, got.data());
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(got[size_t(i)], cpumoe::f32_to_bf16(r.f32[size_t(i) + off])) << "i=" << i;
      for (size_t i = size_t(n); i < got.size(); ++i) ASSERT_EQ(got[i], 0xa5a5) << "wrote past the row";
    }
  }
}

// The bf16 op's activation row: vec::gated_row, then f32_to_bf16.
TEST_P(RowOpsTest, ActivateBf16MatchesTheSteps) {
  std::mt19937 rng(23);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  const std::vector<float> patterns = bit_patterns(4000);
  for (const cpumoe::ActivationSpec& act : cpumoe_test::activation_specs()) {
    for (int64_t inter : {1, 5, 16, 17, 31, 768, 2880}) {
      SCOPED_TRACE(testing::Message() << cpumoe_test::spec_name(act) << " I=" << inter);
      for (int variant = 0; variant < 2; ++variant) {
        std::vector<float> row(size_t(2 * inter));
        for (size_t i = 0; i < row.size(); ++i)
          row[i] = variant == 0 ? nd(rng) : patterns[(i * 7919 + size_t(inter)) % patterns.size()];
        std::vector<float> a(static_cast<size_t>(inter));
        cpumoe::vec::gated_row(act, row.data(), inter, a.data());
        std::vector<uint16_t> got(size_t(inter) + 16, 0xa5a5);
        ops().activate_bf16(act, row.data(), inter, got.data());
        for (int64_t i = 0; i < inter; ++i) {
          // A NaN result is promised as a NaN: which input NaN (sign, payload) an operation on
          // two NaNs passes on is the ISA's and the compiler's operand order, not the definition's.
          if (std::isnan(a[size_t(i)]))
            ASSERT_TRUE((got[size_t(i)] & 0x7f80u) == 0x7f80u && (got[size_t(i)] & 0x7fu) != 0) << "i=" << i;
          else
            ASSERT_EQ(got[size_t(i)], cpumoe::f32_to_bf16(a[size_t(i)])) << "i=" << i;
        }
        for (size_t i = size_t(inter); i < got.size(); ++i) ASSERT_EQ(got[i], 0xa5a5) << "wrote past the row";
      }
    }
  }
}

// A pass over one slot of weight 1 stores 0 + y: every bit pattern through each dtype's store,
// against the portable pass (whose stores StoreRowMatchesScalarBitForBit checks).
TEST_P(RowOpsTest, WeightedSumStoresEveryPatternAsThePortablePass) {
  const std::vector<float> v = bit_patterns(20000);
  const float* ys[1] = {v.data()};
  const float ws[1] = {1.0f};
  const int64_t n = int64_t(v.size());
  std::vector<float> acc(v.size());
  for (DType dt : kDtypes) {
    SCOPED_TRACE(cpumoe::dtype_name(dt));
    std::vector<uint8_t> want(v.size() * 4), got(v.size() * 4);
    rowops::weighted_sum_pass(1, ys, ws, n, true, true, dt, want.data(), acc.data());
    ops().weighted_sum_pass(1, ys, ws, n, true, true, dt, got.data(), acc.data());
    const size_t es = size_t(cpumoe::dtype_size(dt));
    for (size_t i = 0; i < v.size(); ++i) {
      if (dt == DType::f32 && std::isnan(v[i])) {  // 0 + NaN: a NaN (x86 and Arm agree on which)
        float g;
        std::memcpy(&g, &got[4 * i], 4);
        ASSERT_TRUE(std::isnan(g)) << i;
        continue;
      }
      ASSERT_EQ(std::memcmp(&got[es * i], &want[es * i], es), 0)
          << std::hex << "x bits 0x" << cpumoe::f32_bits(v[i]);
    }
  }
}

std::string RowOpsName(const testing::TestParamInfo<const RowOps*>& info) {
  return info.param->name;
}

INSTANTIATE_TEST_SUITE_P(Registry, RowOpsTest, testing::ValuesIn(cpumoe::rowops_registry()),
                         RowOpsName);

TEST(RowOpsRegistry, PortableLastAndChosenWithTheKernel) {
  const auto& reg = cpumoe::rowops_registry();
  ASSERT_FALSE(reg.empty());
  EXPECT_STREQ(reg.back()->name, "rowops_portable");
  EXPECT_EQ(reg.back()->isa, cpumoe::Isa::portable);
  for (size_t i = 0; i < reg.size(); ++i) {
    EXPECT_EQ(std::string(reg[i]->name).rfind("rowops_", 0), 0u) << reg[i]->name;
    EXPECT_EQ(cpumoe::rowops_find(reg[i]->name), reg[i]);
    if (i > 0) {
      EXPECT_GT(int(reg[i - 1]->isa), int(reg[i]->isa)) << "best first";
    }
  }
  EXPECT_EQ(cpumoe::rowops_find("rowops_nope"), nullptr);
  // A portable kernel gets the portable row operations; every ladder level gets a variant this
  // CPU runs at or below its level.
  EXPECT_EQ(cpumoe::rowops_for(cpumoe::Isa::portable), reg.back());
  for (cpumoe::Isa isa : cpumoe::isa_ladder()) {
    const RowOps* r = cpumoe::rowops_for(isa);
    ASSERT_NE(r, nullptr);
    EXPECT_LE(int(r->isa), int(isa)) << cpumoe::isa_name(isa);
    EXPECT_TRUE(cpumoe::cpu_supports(r->isa)) << r->name;
  }
}

}  // namespace
