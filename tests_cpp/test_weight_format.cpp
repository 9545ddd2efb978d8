// The weight-format table (weight_format.h): in enum order, names that round-trip through the
// parser, and what the q4gemm rows promise (a decode table, the scale size prepack reads, the group
// rule the packer enforces) holding for the code that uses them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpumoe/moe.h"
#include "cpumoe/weight_format.h"
#include "moe_test_util.h"

namespace {

using cpumoe::KernelFamily;
using cpumoe::kWeightFormatTable;
using cpumoe::W4Format;
using cpumoe::WeightFormat;
using cpumoe::WeightFormatInfo;

TEST(WeightFormat, TableIsInEnumOrder) {
  ASSERT_EQ(cpumoe::kNumWeightFormats, 7);
  std::set<std::string> names;
  for (int i = 0; i < cpumoe::kNumWeightFormats; ++i) {
    const WeightFormatInfo& info = kWeightFormatTable[i];
    EXPECT_EQ(int(info.format), i) << info.name;
    EXPECT_EQ(&cpumoe::weight_format_info(info.format), &info);
    EXPECT_TRUE(names.insert(info.name).second) << "duplicate name " << info.name;
    EXPECT_EQ(info.zero_point, info.format == WeightFormat::int4_affine ||
                                    info.format == WeightFormat::int8_affine)
        << info.name;
    const bool activations_ok = std::string(info.activations) == "int8" ||
                                std::string(info.activations) == "bf16";
    EXPECT_TRUE(activations_ok) << info.name;
    // Each family runs one op: qgemm and q4gemm the int8 one, bgemm and f8gemm the bf16 one.
    const bool bf16_op = info.family == KernelFamily::bgemm || info.family == KernelFamily::f8gemm;
    EXPECT_EQ(std::string(info.activations), bf16_op ? "bf16" : "int8") << info.name;
    EXPECT_STRNE(cpumoe::kernel_family_name(info.family), "?") << info.name;
    EXPECT_STRNE(cpumoe::scale_kind_name(info.scale), "?") << info.name;
    EXPECT_STRNE(cpumoe::group_rule_name(info.group), "?") << info.name;
  }
  EXPECT_EQ(cpumoe::weight_format_names(), "int8, int4, mxfp4, bf16, fp8, int4_affine, int8_affine");
  EXPECT_EQ(cpumoe::weight_format_names(KernelFamily::f8gemm), "fp8");
  EXPECT_EQ(cpumoe::weight_format_names(KernelFamily::q4gemm), "int4, mxfp4, int4_affine, int8_affine");
}

TEST(WeightFormat, NamesRoundTripThroughTheParser) {
  for (const WeightFormatInfo& info : kWeightFormatTable) {
    WeightFormat f = WeightFormat(-1);
    ASSERT_TRUE(cpumoe::parse_weight_format(info.name, &f)) << info.name;
    EXPECT_EQ(f, info.format);
    EXPECT_STREQ(cpumoe::weight_format_name(f), info.name);
  }
  for (const char* bad : {"", "INT4", "int4 ", "fp8 ", "mxfp", "e4m3"}) {
    WeightFormat f = WeightFormat::bf16;
    EXPECT_FALSE(cpumoe::parse_weight_format(bad, &f)) << bad;
    EXPECT_EQ(f, WeightFormat::bf16) << "untouched on failure";
  }
}

// Every q4gemm row is a W4Format whose kernel format has a decode table that reads its value
// code (int4_affine's codes c run as the int4 nibble c ^ 8, value c - 8); every other row is not
// a W4Format.
TEST(WeightFormat, Q4GemmRowsHaveDecodeTables) {
  // 2 * E2M1 of codes 0-7 (bit 3 the sign).
  const int kE2m1x2[8] = {0, 1, 2, 3, 4, 6, 8, 12};
  int q4_rows = 0;
  for (const WeightFormatInfo& info : kWeightFormatTable) {
    W4Format f = W4Format::int4;
    const bool q4 = cpumoe::w4_format_of(info.format, &f);
    EXPECT_EQ(q4, info.family == KernelFamily::q4gemm) << info.name;
    if (!q4) continue;
    ++q4_rows;
    EXPECT_EQ(cpumoe::weight_format_of(f), info.format);
    EXPECT_STREQ(cpumoe::w4_format_name(f), info.name);
    // Bits per weight: 4, or two 4-bit planes (W4Plan without 8-bit codes), or one 8-bit one.
    EXPECT_EQ(info.bits, 4 * cpumoe::w4_plan(f, false).planes) << info.name;
    EXPECT_EQ(cpumoe::w4_plan(f, true).planes, 1) << info.name;
    const cpumoe::W4Layout with8{cpumoe::w4_plan(f, true).kernel, 32};
    EXPECT_EQ(info.bits, with8.code_bits()) << info.name;
    const int8_t* table = cpumoe::w4_decode_table(cpumoe::w4_plan(f, false).kernel);
    ASSERT_NE(table, nullptr) << info.name;
    const bool uint = std::string(info.value_code) == "uint";
    EXPECT_EQ(uint, info.zero_point) << info.name;  // unsigned codes need their min
    EXPECT_EQ(cpumoe::w4_decode_table(f) == nullptr, uint) << info.name;  // never a kernel's
    for (int c = 0; c < 16; ++c) {
      int want = 0;
      if (std::string(info.value_code) == "int") want = c < 8 ? c : c - 16;
      else if (std::string(info.value_code) == "e2m1") want = (c & 8 ? -1 : 1) * kE2m1x2[c & 7];
      else if (uint) want = c - 8;
      else ADD_FAILURE() << info.name << ": value code " << info.value_code << " not checked here";
      EXPECT_EQ(int(table[uint ? c ^ 8 : c]), want) << info.name << " code " << c;
    }
    EXPECT_NE(info.group, cpumoe::GroupRule::none) << info.name;
    EXPECT_EQ(info.group_size % cpumoe::kW4GroupMultiple, 0) << info.name;
    // The kernel's scale: the table's, without the affine formats' mins (the pipeline's).
    const cpumoe::W4Layout layout{f, info.group_size};
    EXPECT_EQ(layout.scale_bytes(), info.zero_point ? info.scale_bytes / 2 : info.scale_bytes);
    EXPECT_EQ(cpumoe::weight_format_scale_bytes(info.format), info.scale_bytes);
    const int want_bytes = info.scale == cpumoe::ScaleKind::e8m0_per_block             ? 1
                           : info.scale == cpumoe::ScaleKind::fp32_scale_min_per_group ? 8
                                                                                       : 4;
    EXPECT_EQ(info.scale_bytes, want_bytes) << info.name;
  }
  EXPECT_EQ(q4_rows, 4);
  EXPECT_EQ(cpumoe::weight_format_scale_bytes(WeightFormat(8)), 0);
  W4Format f;
  EXPECT_FALSE(cpumoe::w4_format_of(WeightFormat(8), &f));
}

// The group rule of each row is the one the packer enforces (its messages too).
TEST(WeightFormat, GroupRules) {
  for (const WeightFormatInfo& info : kWeightFormatTable) {
    auto problem = [&](int64_t g) { return cpumoe::weight_format_group_problem(info.format, g); };
    switch (info.group) {
      case cpumoe::GroupRule::none:
        EXPECT_EQ(problem(0), "") << info.name;
        EXPECT_NE(problem(32), "") << info.name;
        break;
      case cpumoe::GroupRule::exact:
        EXPECT_EQ(problem(info.group_size), "") << info.name;
        EXPECT_EQ(problem(2 * info.group_size), std::string("group_size: ") + info.name +
                                                    " groups are " +
                                                    std::to_string(info.group_size) + " k, got " +
                                                    std::to_string(2 * info.group_size));
        break;
      case cpumoe::GroupRule::block:  // the k extent; the packer checks it against each depth
        EXPECT_EQ(problem(info.group_size), "") << info.name;
        EXPECT_EQ(problem(1), "") << info.name;
        EXPECT_EQ(problem(0).rfind("group_size: the block's k extent", 0), 0u) << info.name;
        break;
      case cpumoe::GroupRule::multiple:
        EXPECT_EQ(problem(info.group_size), "") << info.name;
        EXPECT_EQ(problem(info.group_max), "") << info.name;
        EXPECT_EQ(problem(info.group_size + 1).rfind("group_size: must be a positive multiple", 0),
                  0u);
        EXPECT_EQ(problem(0).rfind("group_size: must be a positive multiple", 0), 0u);
        EXPECT_EQ(problem(info.group_max + info.group_size).rfind("group_size: at most", 0), 0u);
        break;
    }
  }
}

// One small W4 layer of @p info's format: E = 1, H = I = 64, codes and scales from a fixed
// pattern; scales given in a buffer of exactly E x N x groups x scale_bytes bytes plus a tail.
struct SmallW4 {
  static constexpr int64_t E = 1, H = 64, I = 64;
  const WeightFormatInfo& info;
  W4Format f;
  int64_t g;
  std::vector<uint8_t> w13, w2, s13, s2;
  explicit SmallW4(const WeightFormatInfo& row) : info(row), g(row.group_size) {
    EXPECT_TRUE(cpumoe::w4_format_of(row.format, &f));
    const bool packed_codes = std::string(row.value_code) == "e2m1";  // two codes a byte
    const int bias = std::string(row.value_code) == "uint" ? 0 : 8;    // codes or int4 values
    const int64_t per13 = 2 * I * H, per2 = H * I;
    w13.resize(size_t(packed_codes ? per13 / 2 : per13));
    w2.resize(size_t(packed_codes ? per2 / 2 : per2));
    for (size_t x = 0; x < w13.size(); ++x)
      w13[x] = uint8_t(packed_codes ? x * 37 : x % 16 - bias);
    for (size_t x = 0; x < w2.size(); ++x) w2[x] = uint8_t(packed_codes ? x * 53 : x % 15 - bias + 1);
    const size_t tail = 64;
    s13.assign(size_t(2 * I * (H / g) * row.scale_bytes) + tail, 0xEE);
    s2.assign(size_t(H * (I / g) * row.scale_bytes) + tail, 0xEE);
    fill_scales(&s13, 2 * I * (H / g));
    fill_scales(&s2, H * (I / g));
  }
  void fill_scales(std::vector<uint8_t>* s, int64_t count) const {
    for (int64_t x = 0; x < count; ++x) {
      if (info.scale_bytes == 1) {
        (*s)[size_t(x)] = uint8_t(120 + x % 10);  // E8M0
      } else if (info.scale_bytes == 8) {  // (scale, min)
        const float v[2] = {0.01f * float(1 + x % 7), -0.02f * float(x % 5)};
        std::memcpy(s->data() + x * 8, v, 8);
      } else {
        const float v = 0.01f * float(1 + x % 7);
        std::memcpy(s->data() + x * 4, &v, 4);
      }
    }
  }
  cpumoe::MoeWeightsW4 weights() const {
    cpumoe::MoeWeightsW4 w;
    w.num_experts = E;
    w.hidden = H;
    w.intermediate = I;
    w.format = f;
    w.group_size = g;
    w.w13 = w13.data();
    w.w2 = w2.data();
    w.s13 = s13.data();
    w.s2 = s2.data();
    return w;
  }
};

std::vector<uint8_t> packed_w13(const cpumoe::PackedMoeW4& p) {
  const size_t n = p.kernel().rhs_packed_size(2 * p.intermediate(), p.hidden(), p.layout());
  const auto* b = static_cast<const uint8_t*>(p.w13(0));
  return std::vector<uint8_t>(b, b + n);
}

// Prepack reads exactly scale_bytes per scale (the table's): the bytes after the last scale
// change nothing, the last scale's first byte does; and the packed layer says its row.
TEST(WeightFormat, ScaleBytesAreWhatPrepackReads) {
  const cpumoe::Q4GemmUkernel* portable = cpumoe::q4gemm_registry().back();
  for (const WeightFormatInfo& info : kWeightFormatTable) {
    if (info.family != KernelFamily::q4gemm) continue;
    SmallW4 a(info);
    const cpumoe::PackedMoeW4 pa(a.weights(), portable, 1);
    EXPECT_EQ(pa.weight_format(), info.format);
    EXPECT_STREQ(cpumoe::weight_format_name(pa.weight_format()), info.name);
    SmallW4 tail(info);
    const size_t used = tail.s13.size() - 64;
    for (size_t x = used; x < tail.s13.size(); ++x) tail.s13[x] = 0x11;
    EXPECT_EQ(packed_w13(cpumoe::PackedMoeW4(tail.weights(), portable, 1)), packed_w13(pa))
        << info.name << ": prepack read past E x N x groups x " << info.scale_bytes << " bytes";
    SmallW4 last(info);
    last.s13[used - size_t(info.scale_bytes)] ^= 0x01;
    EXPECT_NE(packed_w13(cpumoe::PackedMoeW4(last.weights(), portable, 1)), packed_w13(pa))
        << info.name << ": the last scale not read at " << info.scale_bytes << " bytes a scale";
  }
}

TEST(WeightFormat, PackedClassesSayTheirRow) {
  constexpr int64_t E = 1, H = 8, I = 8;
  const cpumoe_test::MoeData d =
      cpumoe_test::make_moe_data({1, E, 1, H, I}, cpumoe::DType::f32, cpumoe::Activation::silu,
                                 false, 1);
  const cpumoe::PackedMoe p8(d.weights(), nullptr, 1);
  EXPECT_EQ(p8.weight_format(), WeightFormat::int8);
  EXPECT_EQ(cpumoe::weight_format_info(p8.weight_format()).family, KernelFamily::qgemm);

  std::vector<uint16_t> b13(size_t(E * 2 * I * H), 0x3f80), b2(size_t(E * H * I), 0x3f80);
  cpumoe::MoeWeightsBf16 wb;
  wb.num_experts = E;
  wb.hidden = H;
  wb.intermediate = I;
  wb.w13 = b13.data();
  wb.w2 = b2.data();
  const cpumoe::PackedMoeBf16 p16(wb, nullptr, 1);
  EXPECT_EQ(p16.weight_format(), WeightFormat::bf16);
  EXPECT_EQ(cpumoe::weight_format_info(p16.weight_format()).family, KernelFamily::bgemm);

  std::vector<uint8_t> c13(size_t(E * 2 * I * H), 0x38), c2(size_t(E * H * I), 0x38);  // 1.0
  std::vector<float> s(8, 0.5f);
  cpumoe::MoeWeightsFp8 wf;
  wf.num_experts = E;
  wf.hidden = H;
  wf.intermediate = I;
  wf.w13 = c13.data();
  wf.w2 = c2.data();
  wf.s13 = s.data();
  wf.s2 = s.data();
  const cpumoe::PackedMoeFp8 pf(wf, nullptr, 1);
  EXPECT_EQ(pf.weight_format(), WeightFormat::fp8);
  EXPECT_EQ(cpumoe::weight_format_info(pf.weight_format()).family, KernelFamily::f8gemm);
  EXPECT_EQ(pf.block_n(), 128);
  EXPECT_EQ(pf.block_k(), 128);
}

// The fp8 row's value code is E4M3: the decode of every code (f8gemm.h's e4m3_value) against
// the bit-level definition, and its NaN codes refused at prepack with the element named.
// The message of the ArgumentError @p make throws starts with @p prefix.
template <class F>
void expect_error(F make, const std::string& prefix) {
  try {
    make();
    ADD_FAILURE() << "no error; expected " << prefix;
  } catch (const cpumoe::ArgumentError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(prefix, 0), 0u) << e.what();
  }
}

TEST(WeightFormat, Fp8RowIsE4M3) {
  const WeightFormatInfo& info = cpumoe::weight_format_info(WeightFormat::fp8);
  EXPECT_STREQ(info.value_code, "e4m3");
  EXPECT_EQ(info.bits, 8);
  EXPECT_EQ(info.scale_bytes, 4);
  EXPECT_EQ(info.group, cpumoe::GroupRule::block);
  for (int c = 0; c < 256; ++c) {
    const float v = cpumoe::e4m3_value(uint8_t(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    const int e = (c >> 3) & 15, m = c & 7;
    const double mag =
        e == 0 ? m / 8.0 * std::ldexp(1.0, -6) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
    EXPECT_EQ(double(v), (c & 0x80) ? -mag : mag) << c;
  }
  constexpr int64_t E = 1, H = 64, I = 32;
  std::vector<uint8_t> c13(size_t(E * 2 * I * H), 0x38), c2(size_t(E * H * I), 0x38);
  std::vector<float> s(64, 1.0f);
  cpumoe::MoeWeightsFp8 wf;
  wf.num_experts = E;
  wf.hidden = H;
  wf.intermediate = I;
  wf.block_n = 32;
  wf.block_k = 32;
  wf.w13 = c13.data();
  wf.w2 = c2.data();
  wf.s13 = s.data();
  wf.s2 = s.data();
  c2[77] = 0xFF;
  expect_error([&] { cpumoe::PackedMoeFp8(wf, nullptr, 1); },
               "w2: E4M3 code 255 is NaN (element 77)");
  c2[77] = 0x38;
  wf.block_k = 40;  // neither a multiple of 32 nor spanning H = 64
  expect_error([&] { cpumoe::PackedMoeFp8(wf, nullptr, 1); },
               "block_size: the block's k extent 40 must be a multiple of 32");
  wf.block_k = 32;
  s[3] = -1.0f;
  expect_error([&] { cpumoe::PackedMoeFp8(wf, nullptr, 1); },
               "s13: every scale must be finite and >= 0 (element 3");
}

}  // namespace
