// activation.h: scalar:: against the formulas in double, vec:: against scalar::, the layouts, the
// table and the spec parser. Every activation of the table is swept, the clamped ones at limits
// where their clamps fire inside the sweep and at limits where they do not.
//
// Error model: every activation is g * f(g) * u (swigluoai: g' * f(g') * (u' + 1)) with f a
// sigmoid or normal CDF in [0, 1]. The approximations of f have an *absolute* error, so the error
// of the product scales with |g * u|, not with the (possibly tiny, e.g. silu(-15)) result. The
// tolerances below are therefore relative to that magnitude.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpumoe/activation.h"
#include "activation_specs.h"
#include "reference/reference.h"

namespace {

using cpumoe::Activation;
using cpumoe::ActivationSpec;

using cpumoe_test::spec_name;
const std::vector<ActivationSpec>& kAll = cpumoe_test::activation_specs();

// scalar:: is the formula in fp32 with libm (<= 1 ulp each): about 4 roundings of 6e-8 relative to
// |g u| (measured worst case 1.7e-7 over the sweep below).
constexpr double kScalarTol = 5e-7;
// vec:: replaces libm by polynomials: exp ~1.4 ulp, erf (A&S 7.1.26 evaluated in fp32) up to
// 4.6e-7 absolute near 0, which enters gelu halved; tanh ~1.8e-7 absolute. Measured worst case
// 3.1e-7 of |g u| over the sweep; 1e-6 leaves room for other compilers' code generation.
constexpr double kVecTol = 1e-6;
// A floor for results that are themselves fp32 subnormals, where one ulp is 1.4e-45.
constexpr double kSubnormalFloor = 8 * double(std::numeric_limits<float>::denorm_min());

double magnitude(const ActivationSpec& a, double g, double u) {
  const double L = a.limit;
  const double uc = std::fmin(std::fmax(u, -L), L);
  switch (a.kind) {
    case Activation::swigluoai: return std::fabs(std::fmin(g, L) * (uc + 1.0));
    case Activation::silu_clamp: return std::fabs(std::fmin(g, L) * uc);
    case Activation::silu_clamp_post: return std::fabs(g * uc);
    default: return std::fabs(g * u);
  }
}

// Gates: a dense sweep of [-20, 20] (step 1e-3 hits every region of every f) plus large and small
// magnitudes. Ups: inside and outside the swigluoai clamp, both signs, and 0.
std::vector<float> gate_values() {
  std::vector<float> g;
  for (int i = -20000; i <= 20000; ++i) g.push_back(float(i) * 1e-3f);
  for (float m : {30.0f, 50.0f, 87.0f, 88.5f, 89.0f, 100.0f, 1e3f, 1e10f, 1e30f, 1e-3f, 1e-10f,
                  1e-30f, 1e-40f}) {
    g.push_back(m);
    g.push_back(-m);
  }
  return g;
}
constexpr float kUps[] = {1.0f, -0.37f, 3.0f, 6.99f, 7.0f, 8.5f, -9.0f, 0.0f, 12.0f, -25.0f};

TEST(Activation, ScalarMatchesFormulasInDouble) {
  const std::vector<float> gates = gate_values();
  for (const ActivationSpec& a : kAll) {
    SCOPED_TRACE(spec_name(a));
    for (float u : kUps) {
      for (float g : gates) {
        const double want = cpumoe_ref::activation(a, g, u);
        const float got = cpumoe::scalar::apply(a, g, u);
        ASSERT_NEAR(got, want, kScalarTol * magnitude(a, g, u) + kSubnormalFloor)
            << "g=" << g << " u=" << u;
      }
    }
  }
}

TEST(Activation, VecMatchesScalar) {
  const std::vector<float> gates = gate_values();
  for (const ActivationSpec& a : kAll) {
    SCOPED_TRACE(spec_name(a));
    for (float u : kUps) {
      for (float g : gates) {
        const float want = cpumoe::scalar::apply(a, g, u);
        const float got = cpumoe::vec::apply(a, g, u);
        ASSERT_TRUE(std::isfinite(got)) << "g=" << g << " u=" << u;
        ASSERT_NEAR(got, want, kVecTol * magnitude(a, g, u) + kSubnormalFloor)
            << "g=" << g << " u=" << u;
      }
    }
  }
}

TEST(Activation, NanPropagates) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const ActivationSpec& a : kAll) {
    SCOPED_TRACE(spec_name(a));
    for (auto [g, u] : {std::pair<float, float>{nan, 1.0f}, {1.0f, nan}, {nan, nan}, {0.0f, nan},
                        {-3.0f, nan}, {nan, 20.0f}}) {
      EXPECT_TRUE(std::isnan(cpumoe::scalar::apply(a, g, u))) << g << " " << u;
      EXPECT_TRUE(std::isnan(cpumoe::vec::apply(a, g, u))) << g << " " << u;
      float out = 0.0f;
      cpumoe::vec::gated(a, &g, &u, 1, &out, 1);
      EXPECT_TRUE(std::isnan(out)) << g << " " << u;
    }
  }
  EXPECT_TRUE(std::isnan(cpumoe::vec::exp(nan)));
  EXPECT_TRUE(std::isnan(cpumoe::vec::erf(nan)));
  EXPECT_TRUE(std::isnan(cpumoe::vec::tanh(nan)));
}

TEST(Activation, SwigluClampsGateAndUp) {
  for (float g : {7.0f, 7.5f, 100.0f}) {
    EXPECT_EQ(cpumoe::scalar::swigluoai(g, 2.0f), cpumoe::scalar::swigluoai(7.0f, 2.0f));
    EXPECT_EQ(cpumoe::vec::swigluoai(g, 2.0f), cpumoe::vec::swigluoai(7.0f, 2.0f));
  }
  for (float u : {7.0f, 9.0f, 1e20f}) {
    EXPECT_EQ(cpumoe::scalar::swigluoai(1.5f, u), cpumoe::scalar::swigluoai(1.5f, 7.0f));
    EXPECT_EQ(cpumoe::scalar::swigluoai(1.5f, -u), cpumoe::scalar::swigluoai(1.5f, -7.0f));
    EXPECT_EQ(cpumoe::vec::swigluoai(1.5f, u), cpumoe::vec::swigluoai(1.5f, 7.0f));
    EXPECT_EQ(cpumoe::vec::swigluoai(1.5f, -u), cpumoe::vec::swigluoai(1.5f, -7.0f));
  }
  // The gate is clamped from above only: a very negative gate is not clamped.
  EXPECT_NE(cpumoe::scalar::swigluoai(-8.0f, 2.0f), cpumoe::scalar::swigluoai(-7.0f, 2.0f));
}

TEST(Activation, VecExpStaysFiniteAndNormal) {
  for (float x : {-1e30f, -1000.0f, -104.0f, -87.3f, 88.3f, 89.0f, 1000.0f, 1e30f}) {
    const float e = cpumoe::vec::exp(x);
    EXPECT_TRUE(std::isfinite(e)) << x;
    EXPECT_TRUE(std::isnormal(e)) << x;
  }
}

// The array form is the per-element form applied in a loop, whatever the compiler vectorized:
// without FMA contraction or fast-math the vector code rounds exactly like the scalar code.
TEST(Activation, GatedArrayEqualsElementwiseBitForBit) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-12.0f, 12.0f);
  const int64_t n = 1003;  // not a multiple of any vector width
  for (const ActivationSpec& a : kAll) {
    SCOPED_TRACE(spec_name(a));
    for (int64_t stride : {1, 2, 3}) {
      std::vector<float> gate(size_t(n * stride)), up(size_t(n * stride)), out(static_cast<size_t>(n));
      for (auto& v : gate) v = dist(rng);
      for (auto& v : up) v = dist(rng);
      cpumoe::vec::gated(a, gate.data(), up.data(), stride, out.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const float want = cpumoe::vec::apply(a, gate[size_t(i * stride)], up[size_t(i * stride)]);
        ASSERT_EQ(std::memcmp(&out[size_t(i)], &want, 4), 0) << "i=" << i << " stride=" << stride;
      }
    }
  }
}

TEST(Activation, GateUpLayout) {
  for (int64_t inter : {8, 136}) {
    const cpumoe::GateUpLayout s = cpumoe::gate_up_layout(Activation::swigluoai, inter);
    EXPECT_EQ(s.gate_offset, 0);
    EXPECT_EQ(s.up_offset, 1);
    EXPECT_EQ(s.stride, 2);
    for (Activation a : {Activation::silu, Activation::gelu, Activation::gelu_tanh,
                         Activation::silu_clamp, Activation::silu_clamp_post}) {
      const cpumoe::GateUpLayout l = cpumoe::gate_up_layout(a, inter);
      EXPECT_EQ(l.gate_offset, 0);
      EXPECT_EQ(l.up_offset, inter);
      EXPECT_EQ(l.stride, 1);
    }
  }
}

// gated_row reads gate and up where the op's semantics put them: halves, or even/odd columns for
// swigluoai. Indexing is spelled out here rather than taken from gate_up_layout.
TEST(Activation, GatedRowReadsTheDocumentedColumns) {
  const int64_t inter = 24;
  std::vector<float> row(size_t(2 * inter));
  for (int64_t c = 0; c < 2 * inter; ++c) row[size_t(c)] = 0.25f * float(c) - 5.0f;
  for (const ActivationSpec& a : kAll) {
    SCOPED_TRACE(spec_name(a));
    std::vector<float> out(static_cast<size_t>(inter));
    cpumoe::vec::gated_row(a, row.data(), inter, out.data());
    for (int64_t i = 0; i < inter; ++i) {
      const bool even_odd = a.kind == Activation::swigluoai;
      const float g = row[size_t(even_odd ? 2 * i : i)];
      const float u = row[size_t(even_odd ? 2 * i + 1 : inter + i)];
      const float want = cpumoe::vec::apply(a, g, u);
      ASSERT_EQ(std::memcmp(&out[size_t(i)], &want, 4), 0) << "i=" << i;
    }
  }
}

TEST(Activation, ParseAndName) {
  ASSERT_EQ(cpumoe::kNumActivations, 6);
  for (int i = 0; i < cpumoe::kNumActivations; ++i) {
    const Activation a = cpumoe::kActivationTable[i].kind;
    EXPECT_EQ(int(a), i) << "the table is in enum order";
    Activation got = Activation::silu;
    if (a == Activation::silu) got = Activation::gelu;  // make sure the parser writes
    ASSERT_TRUE(cpumoe::parse_activation(cpumoe::activation_name(a), &got));
    EXPECT_EQ(got, a);
  }
  EXPECT_STREQ(cpumoe::activation_name(Activation::silu_clamp), "silu_clamp");
  EXPECT_STREQ(cpumoe::activation_name(Activation::silu_clamp_post), "silu_clamp_post");
  EXPECT_STREQ(cpumoe::activation_name(Activation::silu), "silu");
  EXPECT_STREQ(cpumoe::activation_name(Activation::gelu), "gelu");
  EXPECT_STREQ(cpumoe::activation_name(Activation::gelu_tanh), "gelu_tanh");
  EXPECT_STREQ(cpumoe::activation_name(Activation::swigluoai), "swigluoai");
  for (const char* bad : {"", "SILU", "relu", "gelu ", " gelu", "gelu_tan", "swiglu", "silux"}) {
    Activation got = Activation::gelu_tanh;
    EXPECT_FALSE(cpumoe::parse_activation(bad, &got)) << "'" << bad << "'";
    EXPECT_EQ(got, Activation::gelu_tanh) << "'" << bad << "'";  // untouched on failure
  }
}

}  // namespace

namespace {

ActivationSpec parse_ok(const std::string& text) {
  ActivationSpec s;
  std::string why;
  EXPECT_TRUE(cpumoe::parse_activation_spec(text, &s, &why)) << text << ": " << why;
  return s;
}

std::string parse_error(const std::string& text) {
  ActivationSpec s(Activation::gelu);
  std::string why;
  EXPECT_FALSE(cpumoe::parse_activation_spec(text, &s, &why)) << text;
  EXPECT_EQ(s.kind, Activation::gelu) << "untouched on failure: " << text;
  return why;
}

}  // namespace

TEST(ActivationSpec, ParsesParametersAndPrintsThemBack) {
  ActivationSpec s = parse_ok("silu_clamp(limit=10)");
  EXPECT_EQ(s.kind, Activation::silu_clamp);
  EXPECT_EQ(s.limit, 10.0f);
  EXPECT_EQ(cpumoe::activation_spec_str(s), "silu_clamp(limit=10)");
  EXPECT_TRUE(cpumoe::activation_spec_problem(s).empty());
  s = parse_ok("swigluoai");
  EXPECT_EQ(s.limit, 7.0f);
  EXPECT_EQ(s.alpha, 1.702f);
  EXPECT_EQ(cpumoe::activation_spec_str(s), "swigluoai");
  s = parse_ok("swigluoai( alpha = 1.5 , limit=0.1 )");
  EXPECT_EQ(s.alpha, 1.5f);
  EXPECT_EQ(s.limit, 0.1f);
  // 9 significant digits: the printed spec parses back to the same floats.
  const ActivationSpec back = parse_ok(cpumoe::activation_spec_str(s));
  EXPECT_EQ(back.limit, s.limit);
  EXPECT_EQ(back.alpha, s.alpha);
  EXPECT_EQ(cpumoe::activation_spec_str(parse_ok("swigluoai(limit=7,alpha=1.702)")), "swigluoai");
  s = parse_ok("silu_clamp_post(limit=inf)");
  EXPECT_TRUE(std::isinf(s.limit));
  EXPECT_TRUE(cpumoe::activation_spec_problem(s).empty());
  EXPECT_EQ(cpumoe::activation_spec_str(parse_ok("gelu()")), "gelu");
  EXPECT_EQ(parse_ok("silu_clamp(limit=+1.5)").limit, 1.5f);
  EXPECT_TRUE(std::isinf(parse_ok("silu_clamp(limit=1e400)").limit));  // past float: inf
}

TEST(ActivationSpec, RefusesWhatCannotRun) {
  EXPECT_NE(parse_error("relu").find("unknown activation 'relu'"), std::string::npos);
  EXPECT_NE(parse_error("relu").find("silu_clamp_post"), std::string::npos);  // lists them
  EXPECT_NE(parse_error("silu(limit=10)").find("silu takes no parameters"), std::string::npos);
  EXPECT_NE(parse_error("silu_clamp(alpha=1)").find("takes limit, not alpha"), std::string::npos);
  EXPECT_NE(parse_error("silu_clamp(limit=ten)").find("not a number"), std::string::npos);
  EXPECT_NE(parse_error("silu_clamp(limit=10").find("expected name("), std::string::npos);
  EXPECT_NE(parse_error("silu_clamp(limit=1,limit=2)").find("given twice"), std::string::npos);
  EXPECT_NE(parse_error("silu_clamp(limit)").find("key=value"), std::string::npos);
  EXPECT_NE(parse_error("silu_clamp(limit=1,)").find("empty parameter"), std::string::npos);
  // Parsed but not runnable: a required limit missing, a limit <= 0 or NaN, alpha not finite.
  EXPECT_NE(cpumoe::activation_spec_problem(parse_ok("silu_clamp")).find("needs limit"),
            std::string::npos);
  EXPECT_NE(cpumoe::activation_spec_problem(ActivationSpec(Activation::silu_clamp_post))
                .find("needs limit"),
            std::string::npos);
  for (const char* bad : {"silu_clamp(limit=0)", "silu_clamp(limit=-3)", "swigluoai(limit=nan)",
                          "swigluoai(limit=-inf)"})
    EXPECT_FALSE(cpumoe::activation_spec_problem(parse_ok(bad)).empty()) << bad;
  EXPECT_NE(cpumoe::activation_spec_problem(parse_ok("swigluoai(alpha=inf)")).find("alpha"),
            std::string::npos);
}

// The clamps: gate from above only (silu_clamp), the silu output from above (silu_clamp_post),
// up from both sides, exactly at the limit; limit = inf is silu bit for bit.
TEST(ActivationSpec, ClampsFireAtTheLimit) {
  const float L = 10.0f;
  const ActivationSpec pre = ActivationSpec::with_limit(Activation::silu_clamp, L);
  const ActivationSpec post = ActivationSpec::with_limit(Activation::silu_clamp_post, L);
  for (float g : {10.0f, 10.5f, 300.0f, 1e30f}) {
    EXPECT_EQ(cpumoe::vec::apply(pre, g, 2.0f), cpumoe::vec::apply(pre, L, 2.0f)) << g;
    EXPECT_EQ(cpumoe::scalar::apply(pre, g, 2.0f), cpumoe::scalar::apply(pre, L, 2.0f)) << g;
  }
  for (float g : {10.5f, 12.0f, 300.0f, 1e30f}) {  // silu(g) > 10 from about g = 10.0005
    EXPECT_EQ(cpumoe::vec::apply(post, g, 2.0f), L * 2.0f) << g;
    EXPECT_EQ(cpumoe::scalar::apply(post, g, 2.0f), L * 2.0f) << g;
  }
  for (float u : {10.0f, 11.0f, 1e20f}) {
    for (const ActivationSpec& a : {pre, post}) {
      EXPECT_EQ(cpumoe::vec::apply(a, 1.5f, u), cpumoe::vec::apply(a, 1.5f, L));
      EXPECT_EQ(cpumoe::vec::apply(a, 1.5f, -u), cpumoe::vec::apply(a, 1.5f, -L));
    }
  }
  EXPECT_NE(cpumoe::vec::apply(pre, -30.0f, 2.0f), cpumoe::vec::apply(pre, -10.0f, 2.0f));
  const float inf = std::numeric_limits<float>::infinity();
  for (float g : {-30.0f, -1.0f, 0.5f, 9.0f, 11.0f, 1e4f}) {
    for (float u : {-1e4f, -3.0f, 0.25f, 50.0f}) {
      const float want = cpumoe::vec::apply(Activation::silu, g, u);
      for (Activation k : {Activation::silu_clamp, Activation::silu_clamp_post}) {
        const float got = cpumoe::vec::apply(ActivationSpec::with_limit(k, inf), g, u);
        EXPECT_EQ(std::memcmp(&got, &want, 4), 0) << g << " " << u;
      }
    }
  }
}
