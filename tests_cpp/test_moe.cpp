// The dispatcher (PackedMoe + fused_moe_int8) against the naive oracle, for every kernel this CPU
// runs; determinism across kernels and thread counts; routing corner cases; argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpumoe/moe.h"
#include "moe_test_util.h"
#include "reference/reference.h"

namespace {

using cpumoe::Activation;
using cpumoe::ArgumentError;
using cpumoe::DType;
using cpumoe_test::make_moe_data;
using cpumoe_test::MoeData;
using cpumoe_test::MoeShape;

// Both sides run the same int32 GEMMs and the same fp32 epilogues; they differ only in the
// activation math (polynomials vs libm in double, <= 3e-7 of |g u|). That can flip a
// requantization rounding (one int8 step times one w2 weight) or an f16/bf16 rounding of the
// activation (which rescales a whole row when it hits the row's max). Measured with the oracle:
// perturbing every activation by 2e-6 relative (several times vec's error) moves outputs by at most
// 0.4% of max|ref| at these shapes (I = 8 is the worst: fewest terms per output). 2e-2 of max|ref|
// plus 2e-2 relative (bf16 output rounding is 0.4%) leaves margin and still fails any wrong
// routing, layout, weight or scale. The bit-exact comparison below is the strict check.
constexpr double kMoeTol = 2e-2;

constexpr int kThreadCounts[] = {1, 2, 3};

double g_worst_error = 0.0;  // largest error seen vs the double oracle, relative to max|ref|

// Runs d on every supported kernel and thread count and checks:
//  - all runs give the same bytes (determinism; row padding of out untouched),
//  - with the oracle using the library's activation forms, the output is identical bit for bit
//    (routing, quantization, epilogue order, dtype rounding and combine order are all exact),
//  - against the oracle in double, the output is within kMoeTol.
void check_all_paths(const MoeData& d) {
  SCOPED_TRACE(testing::Message() << "T=" << d.s.T << " E=" << d.s.E << " k=" << d.s.k
                                  << " H=" << d.s.H << " I=" << d.s.I << " act="
                                  << cpumoe_test::spec_name(d.act) << " dtype="
                                  << cpumoe::dtype_name(d.dtype) << " bias=" << !d.b13_raw.empty()
                                  << " skip_weighted=" << d.skip_weighted);
  std::vector<uint8_t> first;
  std::string first_name;
  for (const cpumoe::QGemmUkernel* kern : cpumoe_test::supported_kernels()) {
    const cpumoe::PackedMoe pk(d.weights(), kern);
    for (int threads : kThreadCounts) {
      std::vector<uint8_t> raw = cpumoe_test::run_moe(pk, d, threads);
      const std::string name = std::string(kern->name) + " threads=" + std::to_string(threads);
      if (first.empty()) {
        first = std::move(raw);
        first_name = name;
      } else {
        ASSERT_TRUE(raw == first) << name << " differs from " << first_name;
      }
    }
  }
  if (d.s.T == 0) {  // nothing may be written
    for (uint8_t b : first) ASSERT_EQ(b, cpumoe_test::kOutPattern);
  }
  const std::vector<float> got = cpumoe_test::output_values(d, first);
  const std::vector<float> exact = cpumoe_ref::fused_moe(d.ref, d.ref_inputs(), cpumoe::vec::apply);
  ASSERT_EQ(got.size(), exact.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::memcmp(&got[i], &exact[i], 4), 0)
        << "element " << i << " (token " << i / size_t(d.s.H) << "): got " << got[i]
        << ", oracle with the library's activation forms " << exact[i];
  const std::vector<float> want = cpumoe_ref::fused_moe(d.ref, d.ref_inputs());
  g_worst_error = std::max(g_worst_error, cpumoe_test::expect_close(got, want, kMoeTol));
}

// --- The grid --------------------------------------------------------------------------------

// Every (T, E, k) of T in {0, 1, 3, 9, 33}, E in {1, 4, 8}, k in {1, 2, 4} (k > E included: the
// same expert repeats), each with bias off and on, and with skip_weighted on and off when k = 1.
// (H, I) walks through all 16 pairs of {8, 16, 64, 136}, shifted per parameter so every test
// meets each pair with several (T, E, k); the full product would not fit the qemu time budget.
constexpr int64_t kGridT[] = {0, 1, 3, 9, 33};
constexpr int64_t kGridE[] = {1, 4, 8};
constexpr int64_t kGridK[] = {1, 2, 4};
constexpr int64_t kGridHI[] = {8, 16, 64, 136};

class MoeGridTest : public testing::TestWithParam<std::tuple<cpumoe::ActivationSpec, DType>> {};

TEST_P(MoeGridTest, MatchesOracle) {
  const auto [act, dtype] = GetParam();
  constexpr DType kBiasTypes[] = {DType::f32, DType::f16, DType::bf16};
  const uint32_t param = 3 * uint32_t(act.kind) + uint32_t(dtype);
  uint32_t n = 0;
  for (int64_t T : kGridT) {
    for (int64_t E : kGridE) {
      for (int64_t k : kGridK) {
        for (bool bias : {false, true}) {
          for (bool skip : {false, true}) {
            if (skip && k != 1) continue;  // skip_weighted is only allowed with k == 1
            const uint32_t hi = (n * 5 + param) % 16;  // 5 is coprime to 16: visits all pairs
            const MoeShape s{T, E, k, kGridHI[hi / 4], kGridHI[hi % 4]};
            MoeData d = make_moe_data(s, dtype, act, bias, 1000 * param + n, kBiasTypes[n % 3]);
            d.skip_weighted = skip;
            check_all_paths(d);
            if (HasFatalFailure()) return;
            ++n;
          }
        }
      }
    }
  }
  RecordProperty("cases", int(n));
  RecordProperty("worst_error_vs_double_oracle", std::to_string(g_worst_error));
  std::cout << "[ moe grid ] " << n << " cases x " << cpumoe_test::supported_kernels().size()
            << " kernels x 3 thread counts; worst error vs the double oracle: " << g_worst_error
            << " of max|ref|" << std::endl;
}

INSTANTIATE_TEST_SUITE_P(All, MoeGridTest, cpumoe_test::grid_params(),
                         cpumoe_test::grid_name);

// --- Routing ---------------------------------------------------------------------------------

TEST(MoeRouting, ZeroTokensDoesNothing) {
  for (int64_t k : {1, 2}) {
    MoeData d = make_moe_data({0, 4, k, 16, 16}, DType::bf16, Activation::silu, true, 7);
    const cpumoe::PackedMoe pk(d.weights());
    const std::vector<uint8_t> raw = cpumoe_test::run_moe(pk, d, 2);
    for (uint8_t b : raw) ASSERT_EQ(b, cpumoe_test::kOutPattern);
  }
}

TEST(MoeRouting, EmptyExperts) {
  MoeData d = make_moe_data({33, 8, 2, 64, 16}, DType::f32, Activation::gelu, true, 8);
  for (int64_t t = 0; t < d.s.T; ++t) {  // only experts 1 and 5 get tokens
    d.ids[size_t(t * d.id_stride)] = t % 2 ? 5 : 1;
    d.ids[size_t(t * d.id_stride + 1)] = t % 2 ? 1 : 5;
  }
  check_all_paths(d);
}

// 300 rows on one expert: more than one row chunk of a GEMM task (256 rows), so tasks start at a
// row offset into the packed activations.
TEST(MoeRouting, AllTokensOnOneExpert) {
  MoeData d = make_moe_data({300, 4, 1, 8, 8}, DType::f16, Activation::silu, false, 9);
  for (int64_t t = 0; t < d.s.T; ++t) d.ids[size_t(t * d.id_stride)] = 3;
  check_all_paths(d);
  MoeData d2 = make_moe_data({300, 4, 2, 16, 24}, DType::f32, Activation::swigluoai, true, 10);
  for (int64_t t = 0; t < d2.s.T; ++t) {
    d2.ids[size_t(t * d2.id_stride)] = 3;
    d2.ids[size_t(t * d2.id_stride + 1)] = 0;
  }
  check_all_paths(d2);
}

// The same expert twice in one row is two slots: its output is added twice, with each weight.
TEST(MoeRouting, DuplicateIdsCountTwice) {
  MoeData d = make_moe_data({9, 4, 2, 16, 16}, DType::f32, Activation::silu, true, 11);
  for (int64_t t = 0; t < d.s.T; ++t)
    d.ids[size_t(t * d.id_stride)] = d.ids[size_t(t * d.id_stride + 1)] = t % 4;
  check_all_paths(d);

  // Same problem with k = 1 and the two weights summed: equal up to fp32 rounding of the sum.
  MoeData d1 = d;
  d1.s.k = 1;
  d1.w_stride = 1;
  d1.id_stride = 1;
  d1.topk_w.assign(size_t(d.s.T), 0.0f);
  d1.ids.assign(size_t(d.s.T), 0);
  for (int64_t t = 0; t < d.s.T; ++t) {
    d1.topk_w[size_t(t)] = d.topk_w[size_t(t * d.w_stride)] + d.topk_w[size_t(t * d.w_stride + 1)];
    d1.ids[size_t(t)] = d.ids[size_t(t * d.id_stride)];
  }
  const cpumoe::PackedMoe pk(d.weights());
  const std::vector<float> two = cpumoe_test::output_values(d, cpumoe_test::run_moe(pk, d, 1));
  const std::vector<float> one = cpumoe_test::output_values(d1, cpumoe_test::run_moe(pk, d1, 1));
  // w0 y + w1 y vs (w0 + w1) y: a few fp32 roundings.
  constexpr double kSumTol = 1e-5;
  cpumoe_test::expect_close(two, one, kSumTol);

  MoeData d4 = make_moe_data({9, 4, 4, 16, 16}, DType::bf16, Activation::gelu_tanh, false, 12);
  for (int64_t t = 0; t < d4.s.T; ++t)
    for (int64_t j = 0; j < 4; ++j) d4.ids[size_t(t * d4.id_stride + j)] = j == 2 ? 1 : 2;
  check_all_paths(d4);
}

// More slots than one internal chunk (16384 slots): tokens 4096.. go to a second chunk.
TEST(MoeRouting, ManyTokensSpanChunks) {
  check_all_paths(make_moe_data({4097, 4, 4, 8, 8}, DType::bf16, Activation::gelu, true, 13));
}

// gpt-oss widths (2880) on one side: deep K in one GEMM, many column tiles in the other.
TEST(MoeShapes, WideLayers) {
  check_all_paths(make_moe_data({5, 4, 2, 2880, 16}, DType::bf16, Activation::swigluoai, true, 27));
  check_all_paths(make_moe_data({5, 4, 2, 16, 2880}, DType::f16, Activation::silu, true, 28));
}

TEST(MoeRouting, Int32AndInt64IdsAgree) {
  const MoeData d = make_moe_data({33, 8, 2, 16, 64}, DType::f16, Activation::gelu_tanh, true, 14);
  for (const cpumoe::QGemmUkernel* kern : cpumoe_test::supported_kernels()) {
    const cpumoe::PackedMoe pk(d.weights(), kern);
    EXPECT_TRUE(cpumoe_test::run_moe(pk, d, 2, true) == cpumoe_test::run_moe(pk, d, 2, false))
        << kern->name;
  }
}

TEST(MoeRouting, ZeroAndNegativeWeights) {
  MoeData d = make_moe_data({9, 4, 2, 16, 16}, DType::f32, Activation::swigluoai, true, 15);
  for (int64_t t = 0; t < d.s.T; ++t) {
    d.topk_w[size_t(t * d.w_stride)] = t % 3 == 0 ? 0.0f : -0.75f;
  }
  check_all_paths(d);
}

TEST(MoeRouting, DefaultThreadCountAndNullWeightsWithSkipWeighted) {
  MoeData d = make_moe_data({33, 4, 1, 64, 16}, DType::bf16, Activation::silu, true, 16);
  d.skip_weighted = true;
  const cpumoe::PackedMoe pk(d.weights());
  const std::vector<uint8_t> one = cpumoe_test::run_moe(pk, d, 1);
  EXPECT_TRUE(cpumoe_test::run_moe(pk, d, 0) == one) << "num_threads = 0 (OpenMP default)";
  MoeData dn = d;
  dn.topk_w.assign(1, 0.0f);  // the weights are not read with skip_weighted...
  std::vector<uint8_t> out(one.size(), cpumoe_test::kOutPattern);
  cpumoe::MoeCall c;
  c.num_tokens = d.s.T;
  c.topk = 1;
  c.x = d.x.data();
  c.x_row_stride = d.x_stride;
  c.dtype = d.dtype;
  c.topk_weights = nullptr;  // ...so they may be absent
  c.topk_ids = d.ids.data();
  c.topk_ids_int64 = true;
  c.topk_ids_row_stride = d.id_stride;
  c.activation = d.act;
  c.skip_weighted = true;
  c.out = out.data();
  c.out_row_stride = d.out_stride;
  c.num_threads = 1;
  cpumoe::fused_moe_int8(pk, c);
  EXPECT_TRUE(out == one);
}

// PackedMoe is documented as shareable: concurrent calls from plain threads, each with its own
// OpenMP team, give the serial answer.
TEST(MoeThreads, ConcurrentCallsShareOnePackedMoe) {
  const MoeData d = make_moe_data({33, 4, 2, 16, 64}, DType::bf16, Activation::gelu, true, 26);
  const cpumoe::PackedMoe pk(d.weights());
  const std::vector<uint8_t> want = cpumoe_test::run_moe(pk, d, 1);
  std::vector<std::vector<uint8_t>> got(3);
  std::vector<std::thread> pool;
  for (size_t i = 0; i < got.size(); ++i)
    pool.emplace_back([&, i] { got[i] = cpumoe_test::run_moe(pk, d, int(i) + 1); });
  for (std::thread& t : pool) t.join();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i] == want) << "thread " << i;
}

#if defined(_OPENMP)
// Called from inside the caller's own OpenMP region (a framework's parallel loop over layers or
// requests), every call must still give the serial answer and stay inside its own scratch.
// (Regression test: per-thread scratch was once indexed with omp_get_thread_num(), the *caller's*
// thread number on parallel_for's serial path, which overflowed it; parallel_for now passes its
// own index, and each caller thread has its own scratch block. The sanitize stage runs it under
// ASan.)
TEST(MoeThreads, CalledFromInsideAnOpenMPRegion) {
  const MoeData d = make_moe_data({9, 4, 2, 16, 16}, DType::f32, Activation::silu, true, 19);
  const cpumoe::PackedMoe pk(d.weights());
  const std::vector<uint8_t> want = cpumoe_test::run_moe(pk, d, 1);
  for (int inner : {1, 2}) {
    std::vector<std::vector<uint8_t>> got(3);
#pragma omp parallel for num_threads(3) schedule(static, 1)
    for (int i = 0; i < 3; ++i) got[size_t(i)] = cpumoe_test::run_moe(pk, d, inner);
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(got[i] == want) << "outer thread " << i << ", num_threads " << inner;
  }
}
#endif

TEST(MoePacked, Accessors) {
  const MoeData d = make_moe_data({1, 3, 1, 16, 24}, DType::f32, Activation::silu, true, 17,
                                  DType::bf16);
  for (const cpumoe::QGemmUkernel* kern : cpumoe_test::supported_kernels()) {
    const cpumoe::PackedMoe pk(d.weights(), kern, 2);
    EXPECT_EQ(pk.num_experts(), 3);
    EXPECT_EQ(pk.hidden(), 16);
    EXPECT_EQ(pk.intermediate(), 24);
    EXPECT_TRUE(pk.has_bias13());
    EXPECT_TRUE(pk.has_bias2());
    EXPECT_EQ(&pk.kernel(), kern);
    // The chain is chosen at prepack: the kernel's row operations and tile policy.
    EXPECT_EQ(pk.config().gemm, kern);
    EXPECT_EQ(pk.config().rowops, cpumoe::rowops_for(kern->isa));
    EXPECT_EQ(pk.config().tiles.rows, cpumoe::MoeTilePolicy{}.rows);
    const cpumoe::PackedMoe from_config(d.weights(), cpumoe::int8_config(nullptr, &kern->isa), 2);
    EXPECT_EQ(from_config.config().gemm, cpumoe::qgemm_select(&kern->isa));
    EXPECT_GE(pk.packed_bytes(), size_t(3 * (2 * 24 * 16 + 16 * 24)));
    for (int64_t e = 0; e < 3; ++e) {
      EXPECT_EQ(pk.s13(e)[5], d.ref.s13[size_t(e * 48 + 5)]);
      EXPECT_EQ(pk.b13(e)[7], d.ref.b13[size_t(e * 48 + 7)]);  // converted from bf16 exactly
      EXPECT_EQ(pk.b2(e)[3], d.ref.b2[size_t(e * 16 + 3)]);
    }
  }
  const MoeData nb = make_moe_data({1, 2, 1, 8, 8}, DType::f32, Activation::silu, false, 18);
  const cpumoe::PackedMoe pk(nb.weights());
  EXPECT_FALSE(pk.has_bias13());
  EXPECT_FALSE(pk.has_bias2());
  EXPECT_EQ(pk.b13(0), nullptr);
  EXPECT_EQ(pk.b2(1), nullptr);
}

// Phases 4-5 (and 6) fused into row tasks (MoeTilePolicy::fuse_gemm1, fuse_gemm2) and phase by
// phase give the same bits, the oracle's, on every kernel: experts of several row chunks (pieces of the GEMM2 packing
// at row offsets), a partial last chunk, 1 and 3 threads (fused and not under the default rule).
TEST(MoeFusion, FusedAndPhasedGiveTheOraclesBits) {
  MoeData d = make_moe_data({700, 3, 2, 64, 40}, DType::bf16, Activation::silu, true, 23);
  const std::vector<float> exact = cpumoe_ref::fused_moe(d.ref, d.ref_inputs(), cpumoe::vec::apply);
  for (const cpumoe::QGemmUkernel* kern : cpumoe_test::supported_kernels()) {
    SCOPED_TRACE(kern->name);
    for (int fuse : {2, 1, 0}) {
      cpumoe::MoeConfig<cpumoe::QGemmUkernel> cfg = cpumoe::int8_config(kern);
      cfg.tiles.fuse_gemm1 = fuse > 0;
      cfg.tiles.fuse_gemm2 = fuse > 1;
      cfg.tiles.rows = 200;  // 3-4 row chunks per expert (rounded up to mr)
      const cpumoe::PackedMoe pk(d.weights(), cfg, 1);
      for (int threads : {1, 3}) {
        SCOPED_TRACE(testing::Message() << "fuse=" << fuse << " threads=" << threads);
        const std::vector<float> got = cpumoe_test::output_values(d, run_moe(pk, d, threads));
        ASSERT_EQ(got.size(), exact.size());
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_EQ(std::memcmp(&got[i], &exact[i], 4), 0) << "element " << i;
      }
    }
  }
}

// A hand-made config is checked as the weights are: a missing kernel or row-op table, a tile
// policy that would cut zero-sized tasks.
TEST(MoePacked, BadConfigIsAnArgumentError) {
  const MoeData d = make_moe_data({1, 2, 1, 16, 16}, DType::f32, Activation::silu, false, 19);
  const cpumoe::MoeConfig<cpumoe::QGemmUkernel> good = cpumoe::int8_config(nullptr);
  auto expect_bad = [&](cpumoe::MoeConfig<cpumoe::QGemmUkernel> cfg, const char* what) {
    try {
      const cpumoe::PackedMoe pk(d.weights(), cfg, 1);
      ADD_FAILURE() << what << ": accepted";
    } catch (const ArgumentError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("config:", 0), 0u) << what << ": " << e.what();
    }
  };
  auto cfg = good;
  cfg.gemm = nullptr;
  expect_bad(cfg, "no kernel");
  cfg = good;
  cfg.rowops = nullptr;
  expect_bad(cfg, "no row operations");
  cfg = good;
  cfg.tiles.rows = 0;
  expect_bad(cfg, "zero rows per task");
  cfg = good;
  cfg.tiles.max_cols = 0;
  expect_bad(cfg, "zero columns per tile");
  cfg = good;
  cfg.tiles.tasks_per_thread = 0;
  expect_bad(cfg, "zero tasks per thread");
  const cpumoe::PackedMoe ok(d.weights(), good, 1);
  EXPECT_EQ(ok.config().gemm, good.gemm);
}

// --- Argument errors -------------------------------------------------------------------------

static_assert(std::is_base_of<std::invalid_argument, ArgumentError>::value,
              "ArgumentError is an invalid_argument");

// A call built from d, writing into `out` (which the caller pre-fills).
cpumoe::MoeCall make_call(const MoeData& d, std::vector<uint8_t>& out) {
  out.assign(size_t(d.s.T * d.out_stride * d.es()), cpumoe_test::kOutPattern);
  return cpumoe_test::make_call(d, out.data(), d.ids.data(), true, 2);
}

// Expects an ArgumentError whose message starts with `arg`, and `out` untouched.
void expect_argument_error(const cpumoe::PackedMoe& pk, const cpumoe::MoeCall& c,
                           const std::vector<uint8_t>& out, const std::string& arg) {
  try {
    cpumoe::fused_moe_int8(pk, c);
    ADD_FAILURE() << "no ArgumentError (expected one about " << arg << ")";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(arg, 0), 0u) << "message: " << e.what();
  }
  for (uint8_t b : out) {
    ASSERT_EQ(b, cpumoe_test::kOutPattern) << "out was written before the error";
  }
}

TEST(MoeErrors, ExpertIdOutOfRange) {
  MoeData d = make_moe_data({9, 4, 2, 16, 16}, DType::f16, Activation::silu, false, 20);
  const cpumoe::PackedMoe pk(d.weights());
  for (int64_t bad : {int64_t(-1), int64_t(4), int64_t(1) << 40}) {
    MoeData db = d;
    db.ids[size_t(5 * db.id_stride + 1)] = bad;  // one bad id, late in the batch
    std::vector<uint8_t> out;
    cpumoe::MoeCall c = make_call(db, out);
    SCOPED_TRACE(testing::Message() << "id " << bad);
    expect_argument_error(pk, c, out, "topk_ids");
    if (bad < (int64_t(1) << 31)) {  // the same as int32 ids
      std::vector<int32_t> ids32(db.ids.begin(), db.ids.end());
      c.topk_ids = ids32.data();
      c.topk_ids_int64 = false;
      expect_argument_error(pk, c, out, "topk_ids");
    }
  }
}

// An activation that cannot run (a clamp without its limit, a limit <= 0 or NaN, an alpha that is
// not finite, a kind outside the table) is an ArgumentError before anything is written, for
// T = 0 too.
TEST(MoeErrors, BadActivationSpec) {
  MoeData d = make_moe_data({3, 4, 2, 16, 16}, DType::f32, Activation::silu, false, 30);
  const cpumoe::PackedMoe pk(d.weights());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const cpumoe::ActivationSpec bad[] = {
      Activation::silu_clamp,  // the limit is required
      Activation::silu_clamp_post,
      cpumoe::ActivationSpec::with_limit(Activation::silu_clamp, 0.0f),
      cpumoe::ActivationSpec::with_limit(Activation::silu_clamp_post, -1.0f),
      cpumoe::ActivationSpec::with_limit(Activation::swigluoai, nan),
      {Activation::swigluoai, 7.0f, inf},
      {static_cast<Activation>(99), 1.0f, 1.0f},
  };
  for (const cpumoe::ActivationSpec& a : bad) {
    for (int64_t T : {int64_t(3), int64_t(0)}) {
      SCOPED_TRACE(testing::Message() << "kind " << int(a.kind) << " T=" << T);
      std::vector<uint8_t> out;
      cpumoe::MoeCall c = make_call(d, out);
      c.activation = a;
      c.num_tokens = T;
      expect_argument_error(pk, c, out, "activation");
    }
  }
}

TEST(MoeErrors, BadTopk) {
  MoeData d = make_moe_data({3, 4, 2, 16, 16}, DType::f32, Activation::silu, false, 21);
  const cpumoe::PackedMoe pk(d.weights());
  std::vector<uint8_t> out;
  cpumoe::MoeCall c = make_call(d, out);
  c.skip_weighted = true;  // k = 2
  expect_argument_error(pk, c, out, "skip_weighted");
  c = make_call(d, out);
  c.topk = 0;
  expect_argument_error(pk, c, out, "topk_ids");
  c.topk = -1;
  expect_argument_error(pk, c, out, "topk_ids");
}

TEST(MoeErrors, BadShapesAndStrides) {
  MoeData d = make_moe_data({3, 4, 2, 16, 16}, DType::bf16, Activation::gelu, false, 22);
  const cpumoe::PackedMoe pk(d.weights());
  std::vector<uint8_t> out;
  cpumoe::MoeCall c = make_call(d, out);
  c.num_tokens = -1;
  expect_argument_error(pk, c, out, "x");
  c = make_call(d, out);
  c.x_row_stride = d.s.H - 1;
  expect_argument_error(pk, c, out, "x");
  c = make_call(d, out);
  c.out_row_stride = d.s.H - 1;
  expect_argument_error(pk, c, out, "out");
  c = make_call(d, out);
  c.topk_ids_row_stride = 1;
  expect_argument_error(pk, c, out, "topk_ids");
  c = make_call(d, out);
  c.topk_weights_row_stride = 1;
  expect_argument_error(pk, c, out, "topk_weights");
  c = make_call(d, out);
  c.x = nullptr;
  expect_argument_error(pk, c, out, "x");
  c = make_call(d, out);
  c.topk_ids = nullptr;
  expect_argument_error(pk, c, out, "topk_ids");
  c = make_call(d, out);
  c.topk_weights = nullptr;  // needed without skip_weighted
  expect_argument_error(pk, c, out, "topk_weights");
}

TEST(MoeErrors, OutOverlappingX) {
  MoeData d = make_moe_data({4, 4, 1, 16, 16}, DType::f32, Activation::silu, false, 23);
  d.out_stride = d.x_stride;
  const cpumoe::PackedMoe pk(d.weights());
  const int64_t span = ((d.s.T - 1) * d.x_stride + d.s.H) * d.es();  // bytes x covers
  // x and out in one buffer: out at offsets that overlap x's span, from either side.
  for (int64_t out_at : {int64_t(0), int64_t(4), span - 4, -span + 4}) {
    SCOPED_TRACE(testing::Message() << "out at x + " << out_at << " bytes");
    std::vector<uint8_t> buf(size_t(4 * span), 0);
    uint8_t* x = buf.data() + 2 * span;
    std::memcpy(x, d.x.data(), size_t(span));
    std::vector<uint8_t> out_unused;
    cpumoe::MoeCall c = make_call(d, out_unused);
    c.x = x;
    c.out = x + out_at;
    const std::vector<uint8_t> before = buf;
    try {
      cpumoe::fused_moe_int8(pk, c);
      ADD_FAILURE() << "overlap not detected";
    } catch (const ArgumentError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("out", 0), 0u) << e.what();
    }
    EXPECT_TRUE(buf == before) << "memory written before the error";
  }
  // Back to back (out starts right after x's last element) is not an overlap.
  std::vector<uint8_t> buf(size_t(3 * span), 0);
  std::memcpy(buf.data(), d.x.data(), size_t(span));
  std::vector<uint8_t> out_unused;
  cpumoe::MoeCall c = make_call(d, out_unused);
  c.x = buf.data();
  c.out = buf.data() + span;
  EXPECT_NO_THROW(cpumoe::fused_moe_int8(pk, c));
}

TEST(MoeErrors, PackedMoeRejectsBadWeights) {
  auto expect_throw = [](const MoeData& d, const char* what) {
    try {
      const cpumoe::PackedMoe pk(d.weights());
      ADD_FAILURE() << "no ArgumentError for " << what;
    } catch (const ArgumentError&) {
    }
  };
  // H or I not a positive multiple of 8. The shapes are built with a valid size and then
  // relabelled, so the arrays are large enough either way.
  for (auto [h, i] : {std::pair<int64_t, int64_t>{12, 8}, {8, 20}, {4, 8}, {8, 4}, {0, 8},
                      {8, 0}, {-8, 8}, {9, 16}}) {
    MoeData d = make_moe_data({1, 2, 1, 32, 32}, DType::f32, Activation::silu, false, 24);
    d.s.H = h;
    d.s.I = i;
    SCOPED_TRACE(testing::Message() << "H=" << h << " I=" << i);
    expect_throw(d, "H/I");
  }
  MoeData d = make_moe_data({1, 2, 1, 16, 16}, DType::f32, Activation::silu, true, 25);
  MoeData e0 = d;
  e0.s.E = 0;
  expect_throw(e0, "E = 0");
  for (float bad : {0.0f, -1.0f, -0.0f, std::nanf(""), INFINITY}) {
    SCOPED_TRACE(testing::Message() << "scale " << bad);
    MoeData a = d;
    a.ref.s13[7] = bad;
    expect_throw(a, "s13");
    MoeData b = d;
    b.ref.s2[b.ref.s2.size() - 1] = bad;
    expect_throw(b, "s2");
  }
  MoeData nw = d;
  nw.ref.w13.clear();
  nw.ref.w13.shrink_to_fit();
  cpumoe::MoeWeights w = nw.weights();
  w.w13 = nullptr;
  EXPECT_THROW(cpumoe::PackedMoe pk(w), ArgumentError);
}

}  // namespace
