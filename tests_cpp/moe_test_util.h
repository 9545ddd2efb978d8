/// @file moe_test_util.h
/// Random MoE problems for the dispatcher tests: weights in the checkpoint layout, strided inputs
/// of any dtype, the library call and the oracle call over the same data.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "activation_specs.h"
#include "cpumoe/moe.h"
#include "reference/reference.h"

namespace cpumoe_test {

using cpumoe::Activation;
using cpumoe::DType;

struct MoeShape {
  int64_t T, E, k, H, I;
};

/// One problem: weights, inputs and call options. Fill with make_moe_data, then adjust fields.
struct MoeData {
  MoeShape s{};
  DType dtype = DType::f32;
  cpumoe::ActivationSpec act = Activation::silu;
  bool skip_weighted = false;
  // Row strides (elements): all larger than the row, so stride handling is always exercised.
  int64_t x_stride = 0, out_stride = 0, w_stride = 0, id_stride = 0;

  cpumoe_ref::MoeProblem ref;            // fp32 biases, for the oracle
  DType b13_dtype = DType::f32, b2_dtype = DType::f32;
  std::vector<uint8_t> b13_raw, b2_raw;  // the biases as the library gets them (may be empty)
  std::vector<uint8_t> x;                // [T, x_stride] of dtype
  std::vector<float> topk_w;             // [T, w_stride]
  std::vector<int64_t> ids;              // [T, id_stride]

  int64_t es() const { return cpumoe::dtype_size(dtype); }

  /// The sizes and biases of any prepack input (MoeWeights, MoeWeightsBf16, MoeWeightsFp8, ...).
  template <class W>
  W sized_weights() const {
    W w;
    w.num_experts = s.E;
    w.hidden = s.H;
    w.intermediate = s.I;
    w.b13 = b13_raw.empty() ? nullptr : b13_raw.data();
    w.b13_dtype = b13_dtype;
    w.b2 = b2_raw.empty() ? nullptr : b2_raw.data();
    w.b2_dtype = b2_dtype;
    return w;
  }

  cpumoe::MoeWeights weights() const {
    auto w = sized_weights<cpumoe::MoeWeights>();
    w.w13 = ref.w13.data();
    w.w2 = ref.w2.data();
    w.s13 = ref.s13.data();
    w.s2 = ref.s2.data();
    return w;
  }

  /// "T=.. E=.. k=.. H=.. I=.. act=.. dtype=.. bias=..": for SCOPED_TRACE.
  std::string describe() const;

  cpumoe_ref::MoeInputs ref_inputs() const {
    cpumoe_ref::MoeInputs in;
    in.T = s.T;
    in.k = s.k;
    in.x = x.data();
    in.x_stride = x_stride;
    in.dtype = dtype;
    in.topk_weights = topk_w.data();
    in.weights_stride = w_stride;
    in.topk_ids = ids.data();
    in.ids_stride = id_stride;
    in.activation = act;
    in.skip_weighted = skip_weighted;
    return in;
  }

  /// Sets element c of token t of x (rounding to the dtype).
  void set_x(int64_t t, int64_t c, float v) { store(x.data(), dtype, t * x_stride + c, v); }

  static void store(void* p, DType dt, int64_t i, float v) {
    switch (dt) {
      case DType::f32: static_cast<float*>(p)[i] = v; break;
      case DType::f16: static_cast<uint16_t*>(p)[i] = cpumoe::f32_to_f16(v); break;
      case DType::bf16: static_cast<uint16_t*>(p)[i] = cpumoe::f32_to_bf16(v); break;
    }
  }
};

/// Random weights and inputs. Scales are chosen so GEMM1 outputs spread over about [-8, 8]
/// (every region of every activation, the swigluoai clamp included) and outputs are O(1).
inline MoeData make_moe_data(MoeShape s, DType dtype, const cpumoe::ActivationSpec& act, bool bias,
                             uint32_t seed,
                             DType bias_dtype = DType::f32) {
  MoeData d;
  d.s = s;
  d.dtype = dtype;
  d.act = act;
  d.x_stride = s.H + 3;
  d.out_stride = s.H + 5;
  d.w_stride = s.k + 2;
  d.id_stride = s.k + 1;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> w8(-128, 127);
  std::uniform_real_distribution<float> unit(0.5f, 1.5f), sym(-1.0f, 1.0f);

  auto& r = d.ref;
  r.E = s.E;
  r.H = s.H;
  r.I = s.I;
  r.w13.resize(size_t(s.E * 2 * s.I * s.H));
  r.w2.resize(size_t(s.E * s.H * s.I));
  for (auto& v : r.w13) v = int8_t(w8(rng));
  for (auto& v : r.w2) v = int8_t(w8(rng));
  // A row of q . w has standard deviation ~ sqrt(H) * 74 * E|x| / s_x: 3 / (74 sqrt(H)) puts h at ~3.
  r.s13.resize(size_t(s.E * 2 * s.I));
  r.s2.resize(size_t(s.E * s.H));
  for (auto& v : r.s13) v = unit(rng) * 3.0f / (74.0f * std::sqrt(float(s.H)));
  for (auto& v : r.s2) v = unit(rng) * 1.0f / (74.0f * std::sqrt(float(s.I)));
  if (bias) {
    d.b13_dtype = d.b2_dtype = bias_dtype;
    const int64_t bes = cpumoe::dtype_size(bias_dtype);
    d.b13_raw.resize(size_t(s.E * 2 * s.I * bes));
    d.b2_raw.resize(size_t(s.E * s.H * bes));
    r.b13.resize(size_t(s.E * 2 * s.I));
    r.b2.resize(size_t(s.E * s.H));
    for (int64_t i = 0; i < s.E * 2 * s.I; ++i) {
      MoeData::store(d.b13_raw.data(), bias_dtype, i, sym(rng));
      r.b13[size_t(i)] = cpumoe::load_as_f32(d.b13_raw.data(), bias_dtype, i);
    }
    for (int64_t i = 0; i < s.E * s.H; ++i) {
      MoeData::store(d.b2_raw.data(), bias_dtype, i, 0.5f * sym(rng));
      r.b2[size_t(i)] = cpumoe::load_as_f32(d.b2_raw.data(), bias_dtype, i);
    }
  }

  // Inputs. Row padding holds NaN garbage: the op must never read it.
  d.x.assign(size_t(std::max<int64_t>(1, s.T * d.x_stride) * d.es()), 0xff);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t t = 0; t < s.T; ++t)
    for (int64_t c = 0; c < s.H; ++c) d.set_x(t, c, 2.0f * normal(rng));
  // One all-zero token, and one whose max |x| is below the amax floor (1e-7; in f16 these are
  // subnormals): both get their scale from the floor, the second quantizes to small non-zero ints.
  if (s.T >= 3)
    for (int64_t c = 0; c < s.H; ++c) d.set_x(1, c, 0.0f);
  if (s.T >= 9)
    for (int64_t c = 0; c < s.H; ++c) d.set_x(2, c, 0.9e-7f * std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng));

  d.topk_w.assign(size_t(std::max<int64_t>(1, s.T * d.w_stride)), std::nanf(""));
  d.ids.assign(size_t(std::max<int64_t>(1, s.T * d.id_stride)), -1);  // padding: invalid ids
  std::vector<int64_t> perm(size_t(s.E));
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t t = 0; t < s.T; ++t) {
    // Distinct experts per token when k <= E (as top-k gives), repeats otherwise.
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < s.k; ++j) {
      d.ids[size_t(t * d.id_stride + j)] =
          s.k <= s.E ? perm[size_t(j)] : int64_t(rng() % uint32_t(s.E));
      d.topk_w[size_t(t * d.w_stride + j)] = std::uniform_real_distribution<float>(0.05f, 1.0f)(rng);
    }
  }
  return d;
}

/// The library's output buffer of a call: [T, out_stride] raw elements, the row padding (and a
/// fully padded buffer for T = 0) pre-filled with kOutPattern.
constexpr uint8_t kOutPattern = 0xcd;

/// A call of the op on d writing into `out`, with ids from `ids` (int64 or int32).
inline cpumoe::MoeCall make_call(const MoeData& d, void* out, const void* ids, bool ids_int64,
                                 int threads) {
  cpumoe::MoeCall c;
  c.num_tokens = d.s.T;
  c.topk = d.s.k;
  c.x = d.x.data();
  c.x_row_stride = d.x_stride;
  c.dtype = d.dtype;
  c.topk_weights = d.topk_w.data();
  c.topk_weights_row_stride = d.w_stride;
  c.topk_ids = ids;
  c.topk_ids_int64 = ids_int64;
  c.topk_ids_row_stride = d.id_stride;
  c.activation = d.act;
  c.skip_weighted = d.skip_weighted;
  c.out = out;
  c.out_row_stride = d.out_stride;
  c.num_threads = threads;
  return c;
}

/// The op of each packed kind: int8 activations (W8A8, W4A8) or bf16 ones (BF16, FP8).
inline void run_packed(const cpumoe::PackedMoe& p, const cpumoe::MoeCall& c) {
  cpumoe::fused_moe_int8(p, c);
}
inline void run_packed(const cpumoe::PackedMoeW4& p, const cpumoe::MoeCall& c) {
  cpumoe::fused_moe_int8(p, c);
}
inline void run_packed(const cpumoe::PackedMoeBf16& p, const cpumoe::MoeCall& c) {
  cpumoe::fused_moe_bf16(p, c);
}
inline void run_packed(const cpumoe::PackedMoeFp8& p, const cpumoe::MoeCall& c) {
  cpumoe::fused_moe_bf16(p, c);
}

/// Runs the op of @p pk's kind on d; ids are passed as int64 or as a converted int32 copy; an
/// optional expert map over @p num_global experts. The raw output (row padding kOutPattern).
template <class Packed>
std::vector<uint8_t> run_moe(const Packed& pk, const MoeData& d, int threads,
                             bool ids_int64 = true, const int32_t* expert_map = nullptr,
                             int64_t num_global = 0) {
  std::vector<uint8_t> out(size_t(std::max<int64_t>(1, d.s.T * d.out_stride) * d.es()),
                           kOutPattern);
  std::vector<int32_t> ids32(d.ids.begin(), d.ids.end());
  const void* ids = ids_int64 ? static_cast<const void*>(d.ids.data()) : ids32.data();
  cpumoe::MoeCall c = make_call(d, out.data(), ids, ids_int64, threads);
  c.expert_map = expert_map;
  c.num_global_experts = num_global;
  run_packed(pk, c);
  return out;
}

/// The kernels of @p registry this CPU runs.
template <class Kernel>
std::vector<const Kernel*> supported_kernels(const std::vector<const Kernel*>& registry) {
  std::vector<const Kernel*> out;
  for (const Kernel* k : registry)
    if (cpumoe::cpu_supports(k->isa)) out.push_back(k);
  return out;
}

/// Dense [T, H] fp32 view of a raw output buffer; fails the test if row padding was written.
inline std::vector<float> output_values(const MoeData& d, const std::vector<uint8_t>& raw) {
  const int64_t es = d.es();
  std::vector<float> v(size_t(d.s.T * d.s.H));
  for (int64_t t = 0; t < d.s.T; ++t) {
    for (int64_t c = 0; c < d.s.H; ++c)
      v[size_t(t * d.s.H + c)] = cpumoe::load_as_f32(raw.data(), d.dtype, t * d.out_stride + c);
    for (int64_t b = (t * d.out_stride + d.s.H) * es; b < (t + 1) * d.out_stride * es; ++b) {
      EXPECT_EQ(raw[size_t(b)], kOutPattern) << "row padding of out written, token " << t;
      if (raw[size_t(b)] != kOutPattern) break;
    }
  }
  return v;
}

/// Kernels of the registry this CPU runs.
inline std::vector<const cpumoe::QGemmUkernel*> supported_kernels() {
  std::vector<const cpumoe::QGemmUkernel*> out;
  for (const cpumoe::QGemmUkernel* k : cpumoe::qgemm_registry())
    if (cpumoe::cpu_supports(k->isa)) out.push_back(k);
  return out;
}

/// |got - want| <= tol * (max|want| + |want|) elementwise; returns the largest error seen
/// relative to max|want| (for reporting).
inline double expect_close(const std::vector<float>& got, const std::vector<float>& want,
                           double tol) {
  EXPECT_EQ(got.size(), want.size());
  double scale = 0.0;
  for (float w : want) scale = std::max(scale, double(std::fabs(w)));
  double worst = 0.0;
  int reported = 0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    const double err = std::fabs(double(got[i]) - double(want[i]));
    worst = std::max(worst, scale > 0 ? err / scale : err);
    if (!(err <= tol * (scale + std::fabs(want[i]))) && reported++ < 5)
      ADD_FAILURE() << "element " << i << ": got " << got[i] << " want " << want[i]
                    << " (output scale " << scale << ")";
  }
  return worst;
}

inline std::string MoeData::describe() const {
  return "T=" + std::to_string(s.T) + " E=" + std::to_string(s.E) + " k=" + std::to_string(s.k) +
         " H=" + std::to_string(s.H) + " I=" + std::to_string(s.I) + " act=" + spec_name(act) +
         " dtype=" + cpumoe::dtype_name(dtype) + " bias=" + (b13_raw.empty() ? "0" : "1");
}

/// Packs @p weights for each of @p kernels (as Packed) and runs d on 1, 2 and 3 threads: the same
/// bytes each time, nothing written for T = 0, and within @p tol of @p want (expect_close).
/// Returns the worst error seen (of max|want|).
template <class Packed, class Kernel, class Weights>
double check_kernels(const std::vector<const Kernel*>& kernels, const Weights& weights,
                     const MoeData& d, const std::vector<float>& want, double tol) {
  double worst = 0.0;
  for (const Kernel* kern : kernels) {
    SCOPED_TRACE(kern->name);
    const Packed pk(weights, kern);
    const std::vector<uint8_t> first = run_moe(pk, d, 1);
    for (int threads : {2, 3}) {
      EXPECT_TRUE(run_moe(pk, d, threads) == first) << "threads=" << threads;
    }
    if (d.s.T == 0) {
      for (uint8_t v : first) EXPECT_EQ(v, kOutPattern);
    }
    worst = std::max(worst, expect_close(output_values(d, first), want, tol));
    if (testing::Test::HasFailure()) break;
  }
  return worst;
}

/// The parameters of the MoE grids (every activation spec x every input dtype), and the test
/// name of one.
using GridParam = std::tuple<cpumoe::ActivationSpec, DType>;
inline auto grid_params() {
  return testing::Combine(testing::ValuesIn(moe_activation_specs()),
                          testing::Values(DType::f32, DType::f16, DType::bf16));
}
inline std::string grid_name(const testing::TestParamInfo<GridParam>& info) {
  return spec_id(std::get<0>(info.param)) + "_" + cpumoe::dtype_name(std::get<1>(info.param));
}

/// The bf16-activation ops' grid for one (activation, dtype): 30 cases, T in {0, 1, 3, 9, 33} x
/// E in {1, 8} x k in {1, 2, 4}; bias alternates; (H, I) walks all 16 pairs of {8, 16, 64, 136}
/// across cases (5 is coprime to 16); bf16 or f32 biases; skip_weighted on some k = 1 cases.
/// visit(MoeData, n) runs case n; stops at the first failure. Prints how many cases ran on
/// @p kernels kernels and @p worst (the visits' worst error of max|ref|) under @p label.
template <class Visit>
void bf16_op_grid(const GridParam& param, uint32_t seed, const char* label, size_t kernels,
                  const double& worst, Visit visit) {
  const auto [act, dtype] = param;
  constexpr int64_t kT[] = {0, 1, 3, 9, 33};
  constexpr int64_t kHI[] = {8, 16, 64, 136};
  const uint32_t p = 3 * uint32_t(act.kind) + uint32_t(dtype);
  uint32_t n = 0;
  for (int64_t T : kT)
    for (int64_t E : {1, 8})
      for (int64_t k : {1, 2, 4}) {
        const uint32_t hi = (n * 5 + p) % 16;
        MoeData d = make_moe_data({T, E, k, kHI[hi / 4], kHI[hi % 4]}, dtype, act, n % 2 == 0,
                                  seed + 1000 * p + n, n % 4 ? DType::bf16 : DType::f32);
        d.skip_weighted = k == 1 && n % 4 == 1;
        visit(std::move(d), n);
        if (testing::Test::HasFailure()) return;
        ++n;
      }
  std::cout << "[ " << label << " grid ] " << n << " cases x " << kernels
            << " kernels, worst error vs the double oracle " << worst << " of max|ref|"
            << std::endl;
}

}  // namespace cpumoe_test
