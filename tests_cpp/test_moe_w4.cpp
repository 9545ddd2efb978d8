// The W4A8 op (PackedMoeW4 + fused_moe_int8) against the naive oracle (cpumoe_ref::fused_moe_w4),
// for every q4gemm kernel this CPU runs, int4 and int4_affine at several group sizes, mxfp4 and
// int8_affine (int4_affine: the kernels' int4 sums plus the pipeline's group offsets;
// int8_affine: two such planes): bit for bit with
// the library's activation forms, the same bytes on every kernel and thread count; NaN scales;
// argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "../csrc/moe/scratch.h"  // thread_scratch(): where the calling thread's block starts
#include "cpumoe/moe.h"
#include "moe_test_util.h"
#include "reference/reference.h"

namespace {

using cpumoe::Activation;
using cpumoe::ArgumentError;
using cpumoe::DType;
using cpumoe::W4Format;
using cpumoe_test::make_moe_data;
using cpumoe_test::MoeData;
using cpumoe_test::MoeShape;

// A W4A8 problem: make_moe_data's inputs, routing and biases with 4-bit weights: the oracle's
// codes and scale bytes, and the library's input form (int4: values one per int8; mxfp4: two
// codes per byte, low nibble first).
struct W4Data {
  MoeData d;
  cpumoe_ref::MoeProblemW4 ref;
  std::vector<int8_t> v13, v2;        // int4 input values
  std::vector<uint8_t> blk13, blk2;   // mxfp4 input blocks

  cpumoe::MoeWeightsW4 weights() const {
    cpumoe::MoeWeightsW4 w;
    w.num_experts = ref.E;
    w.hidden = ref.H;
    w.intermediate = ref.I;
    w.format = ref.format;
    w.group_size = ref.group;
    w.act_quant = ref.act_quant;
    const bool mx = ref.format == W4Format::mxfp4;
    w.w13 = mx ? static_cast<const void*>(blk13.data()) : v13.data();
    w.w2 = mx ? static_cast<const void*>(blk2.data()) : v2.data();
    w.s13 = ref.s13.data();
    w.s2 = ref.s2.data();
    w.b13 = d.b13_raw.empty() ? nullptr : d.b13_raw.data();
    w.b13_dtype = d.b13_dtype;
    w.b2 = d.b2_raw.empty() ? nullptr : d.b2_raw.data();
    w.b2_dtype = d.b2_dtype;
    return w;
  }
};

// Group scales chosen as make_moe_data's channel scales are (GEMM1 outputs over about [-8, 8]):
// a 4-bit value has about a tenth of an int8 weight's spread.
W4Data make_w4(MoeShape s, W4Format f, int64_t g, DType dtype, const cpumoe::ActivationSpec& act, bool bias,
               uint32_t seed) {
  W4Data w;
  w.d = make_moe_data(s, dtype, act, bias, seed);
  auto& r = w.ref;
  r.E = s.E;
  r.H = s.H;
  r.I = s.I;
  r.format = f;
  r.group = g;
  r.b13 = w.d.ref.b13;
  r.b2 = w.d.ref.b2;
  std::mt19937 rng(seed * 7 + 1);
  const bool mx = f == W4Format::mxfp4;
  auto fill = [&](std::vector<uint8_t>& codes, std::vector<uint8_t>& sc, int64_t n, int64_t k,
                  std::vector<int8_t>& vals, std::vector<uint8_t>& blk) {
    codes.resize(size_t(s.E * n * k));
    const bool bytes = f == W4Format::int8_affine;
    for (auto& c : codes) c = uint8_t(rng() & (bytes ? 255 : 15));
    const int64_t groups = s.E * n * (k / g);
    const double want = 3.0 / ((mx ? 6.0 : 4.6) * std::sqrt(double(k)));  // h ~ 3 per unit x
    std::uniform_real_distribution<float> unit(0.5f, 1.5f);
    if (mx) {
      sc.resize(size_t(groups));
      const int e0 = int(std::lround(std::log2(want))) + 128;
      for (auto& e : sc) e = uint8_t(e0 + int(rng() % 3) - 1);
      blk.resize(codes.size() / 2);
      for (size_t x = 0; x < blk.size(); ++x)
        blk[x] = uint8_t(codes[2 * x] | (codes[2 * x + 1] << 4));
    } else if (cpumoe::w4_affine(f)) {  // mins near -8 (-128) scales: values about centred
      sc.resize(size_t(groups) * 8);
      const float mid = bytes ? 128.0f : 8.0f, unit_scale = bytes ? 1.0f / 16 : 1.0f;
      std::uniform_real_distribution<float> shift(-mid - 1.5f, -mid + 1.5f);
      for (int64_t x = 0; x < groups; ++x) {
        const float scale = unit(rng) * float(want) * unit_scale;
        const float pair[2] = {scale, scale * shift(rng)};
        std::memcpy(sc.data() + 8 * x, pair, 8);
      }
      vals.assign(codes.begin(), codes.end());  // the codes themselves, as uint8 input
    } else {
      sc.resize(size_t(groups) * 4);
      for (int64_t x = 0; x < groups; ++x) {
        const float v = unit(rng) * float(want);
        std::memcpy(sc.data() + 4 * x, &v, 4);
      }
      vals.resize(codes.size());
      for (size_t x = 0; x < codes.size(); ++x) vals[x] = cpumoe_ref::w4_value(f, codes[x]);
    }
  };
  fill(r.w13, r.s13, 2 * s.I, s.H, w.v13, w.blk13);
  fill(r.w2, r.s2, s.H, s.I, w.v2, w.blk2);
  return w;
}

std::vector<const cpumoe::Q4GemmUkernel*> supported_w4_kernels() {
  std::vector<const cpumoe::Q4GemmUkernel*> out;
  for (const cpumoe::Q4GemmUkernel* k : cpumoe::q4gemm_registry())
    if (cpumoe::cpu_supports(k->isa)) out.push_back(k);
  return out;
}

// Bit for bit against the oracle (NaN where it has NaN), on every kernel and 1-3 threads.
void expect_oracle_bits(const std::vector<float>& got, const std::vector<float>& exact) {
  ASSERT_EQ(got.size(), exact.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(exact[i])) {
      ASSERT_TRUE(std::isnan(got[i])) << "element " << i << ": got " << got[i] << ", want NaN";
    } else {
      ASSERT_EQ(std::memcmp(&got[i], &exact[i], 4), 0)
          << "element " << i << ": got " << got[i] << " want " << exact[i];
    }
  }
}

// The oracle's bits for @p kern: int8_affine as that kernel runs it (8-bit codes or two
// planes, cpumoe::W4Plan); computed once per form.
class Oracle {
 public:
  explicit Oracle(const W4Data& w) : w_(w) {}
  const std::vector<float>& operator()(const cpumoe::Q4GemmUkernel* kern) {
    const bool planes = w_.ref.format == W4Format::int8_affine && !kern->codes8;
    std::vector<float>& out = exact_[planes ? 1 : 0];
    if (out.empty()) {
      cpumoe_ref::MoeProblemW4 p = w_.ref;
      p.int8_planes = planes;
      out = cpumoe_ref::fused_moe_w4(p, w_.d.ref_inputs(), cpumoe::vec::apply);
    }
    return out;
  }

 private:
  const W4Data& w_;
  std::vector<float> exact_[2];
};

void check_all_w4_paths(const W4Data& w) {
  SCOPED_TRACE(testing::Message() << cpumoe::w4_format_name(w.ref.format) << " g=" << w.ref.group
                                  << (w.ref.act_quant == cpumoe::ActQuant::group
                                          ? " activations per group" : "")
                                  << " T=" << w.d.s.T << " E=" << w.d.s.E << " k=" << w.d.s.k
                                  << " H=" << w.d.s.H << " I=" << w.d.s.I << " act="
                                  << cpumoe_test::spec_name(w.d.act) << " dtype="
                                  << cpumoe::dtype_name(w.d.dtype));
  // The same bytes on every kernel of one form (int8_affine: 8-bit codes or two planes).
  std::vector<uint8_t> first[2];
  Oracle oracle(w);
  for (const cpumoe::Q4GemmUkernel* kern : supported_w4_kernels()) {
    const cpumoe::PackedMoeW4 pk(w.weights(), kern);
    std::vector<uint8_t>& f = first[pk.planes() - 1];
    const bool new_form = f.empty();
    for (int threads : {1, 2, 3}) {
      std::vector<uint8_t> raw = cpumoe_test::run_moe(pk, w.d, threads);
      if (f.empty()) {
        f = std::move(raw);
      } else {
        ASSERT_TRUE(raw == f) << kern->name << " threads=" << threads << " differs";
      }
    }
    if (new_form) {
      SCOPED_TRACE(kern->name);
      expect_oracle_bits(cpumoe_test::output_values(w.d, f), oracle(kern));
      if (testing::Test::HasFatalFailure()) return;
    }
  }
}

struct Fmt {
  W4Format f;
  int64_t g;
};
constexpr Fmt kFormats[] = {{W4Format::int4, 32},        {W4Format::int4, 64},
                            {W4Format::int4, 128},       {W4Format::mxfp4, 32},
                            {W4Format::int4_affine, 32}, {W4Format::int4_affine, 128},
                            {W4Format::int8_affine, 32}, {W4Format::int8_affine, 64}};

// T in {0, 1, 3, 9, 33}, E in {1, 4, 8}, k in {1, 2, 4}, every activation and dtype in turn,
// bias off and on; (H, I) multiples of the group.
TEST(MoeW4, GridMatchesOracle) {
  const std::vector<cpumoe::ActivationSpec>& kActs = cpumoe_test::moe_activation_specs();
  constexpr DType kTypes[] = {DType::f32, DType::f16, DType::bf16};
  uint32_t n = 0;
  for (const Fmt& fm : kFormats) {
    for (int64_t T : {0, 1, 3, 9, 33}) {
      for (int64_t E : {1, 4, 8}) {
        for (int64_t k : {1, 2, 4}) {
          const int64_t H = fm.g * (1 + n % 3), I = fm.g * (1 + (n / 3) % 2);
          const W4Data w = make_w4({T, E, k, H, I}, fm.f, fm.g, kTypes[n % 3], kActs[(n / 3) % kActs.size()],
                                   n % 2 == 1, 500 + n);
          check_all_w4_paths(w);
          if (HasFatalFailure()) return;
          ++n;
        }
      }
    }
  }
  std::cout << "[ moe w4 grid ] " << n << " cases x " << supported_w4_kernels().size()
            << " kernels x 3 thread counts, bit for bit" << std::endl;
}

// Activations quantized per weight group (ActQuant::group): every format, each activation and
// dtype in turn, bias off and on, decode to a few row tiles; bit for bit on every kernel.
TEST(MoeW4, GroupActivationsMatchOracle) {
  const std::vector<cpumoe::ActivationSpec>& kActs = cpumoe_test::moe_activation_specs();
  constexpr DType kTypes[] = {DType::f32, DType::f16, DType::bf16};
  uint32_t n = 0;
  for (const Fmt& fm : kFormats)
    for (int64_t T : {1, 9, 33})
      for (int64_t k : {1, 4}) {
        const int64_t H = fm.g * (2 + n % 2), I = fm.g * (1 + (n / 2) % 2);
        W4Data w = make_w4({T, 4 + 4 * (n % 2), k, H, I}, fm.f, fm.g, kTypes[n % 3],
                           kActs[n % kActs.size()], n % 2 == 0, 900 + n);
        w.ref.act_quant = cpumoe::ActQuant::group;
        check_all_w4_paths(w);
        if (HasFatalFailure()) return;
        ++n;
      }
}

// A kernel without 8-bit codes (Q4GemmUkernel::codes8 false: a new kernel need not have them)
// gets int8_affine layers as two int4 planes (W4Plan): each kernel of this CPU posing as one
// gives the two-plane oracle's bits, at decode and prefill, with group activations too.
TEST(MoeW4, KernelsWithoutEightBitCodesRunTwoPlanes) {
  for (int64_t T : {1, 70}) {
    W4Data w = make_w4({T, 4, 2, 128, 64}, W4Format::int8_affine, 32, DType::bf16,
                       Activation::swigluoai, true, 43);
    if (T > 1) w.ref.act_quant = cpumoe::ActQuant::group;
    cpumoe_ref::MoeProblemW4 planes = w.ref;
    planes.int8_planes = true;
    const std::vector<float> exact =
        cpumoe_ref::fused_moe_w4(planes, w.d.ref_inputs(), cpumoe::vec::apply);
    for (const cpumoe::Q4GemmUkernel* kern : supported_w4_kernels()) {
      SCOPED_TRACE(testing::Message() << kern->name << " T=" << T);
      cpumoe::Q4GemmUkernel nibbles = *kern;
      nibbles.codes8 = false;
      const cpumoe::PackedMoeW4 pk(w.weights(), &nibbles, 2);
      EXPECT_EQ(pk.planes(), 2);
      EXPECT_EQ(pk.layout().format, W4Format::int4);
      expect_oracle_bits(cpumoe_test::output_values(w.d, run_moe(pk, w.d, 2)), exact);
      if (HasFatalFailure()) return;
    }
  }
}

// GGUF Q8_0 as cpumoe reads it: int8_affine with min = -128 * scale, so every 8-bit-code offset
// min + 128 * scale is zero. The packed layer then keeps no offsets (nor sums rows per group)
// and still gives the oracle's bits, which add the zero term; the two-plane form keeps its
// planes' offsets (8 * scale for the lo one).
TEST(MoeW4, ZeroOffsetsAreDropped) {
  for (int64_t T : {1, 40}) {
    W4Data w = make_w4({T, 4, 2, 128, 64}, W4Format::int8_affine, 32, DType::bf16,
                       Activation::silu, true, 41);
    for (std::vector<uint8_t>* sc : {&w.ref.s13, &w.ref.s2})
      for (size_t x = 0; x < sc->size(); x += 8) {
        float pair[2];
        std::memcpy(pair, sc->data() + x, 8);
        pair[1] = -128.0f * pair[0];
        std::memcpy(sc->data() + x, pair, 8);
      }
    Oracle oracle(w);
    for (const cpumoe::Q4GemmUkernel* kern : supported_w4_kernels()) {
      SCOPED_TRACE(testing::Message() << kern->name << " T=" << T);
      const cpumoe::PackedMoeW4 pk(w.weights(), kern, 2);
      EXPECT_EQ(pk.o13(0) == nullptr, kern->codes8);
      EXPECT_EQ(pk.o2(3) == nullptr, kern->codes8);
      for (int threads : {1, 2})
        expect_oracle_bits(cpumoe_test::output_values(w.d, run_moe(pk, w.d, threads)),
                           oracle(kern));
      if (HasFatalFailure()) return;
    }
  }
}

// Prefill-sized calls: GEMM1 fused with the activation and GEMM2's packing (several row chunks
// per expert), with GEMM2 too, and phase by phase give the oracle's bits.
TEST(MoeW4, FusedAndPhasedGiveTheOraclesBits) {
  for (const Fmt& fm : {Fmt{W4Format::int4, 128}, Fmt{W4Format::mxfp4, 32},
                        Fmt{W4Format::int4_affine, 64}, Fmt{W4Format::int4_affine, 32},
                        Fmt{W4Format::int8_affine, 32}}) {
    W4Data w = make_w4({700, 3, 2, 128, 256}, fm.f, fm.g, DType::bf16, Activation::swigluoai,
                       true, 23);
    // The last one with its activations per group (the group scales through every phase).
    if (fm.f == W4Format::int4_affine && fm.g == 32) w.ref.act_quant = cpumoe::ActQuant::group;
    Oracle oracle(w);
    for (const cpumoe::Q4GemmUkernel* kern : supported_w4_kernels()) {
      const std::vector<float>& exact = oracle(kern);
      for (int fuse : {2, 1, 0}) {
        SCOPED_TRACE(testing::Message() << kern->name << " fuse=" << fuse);
        cpumoe::MoeConfig<cpumoe::Q4GemmUkernel> cfg = cpumoe::w4_config(kern);
        cfg.tiles.fuse_gemm1 = fuse > 0;
        cfg.tiles.fuse_gemm2 = fuse > 1;
        cfg.tiles.rows = 200;
        const cpumoe::PackedMoeW4 pk(w.weights(), cfg, 1);
        for (int threads : {1, 3}) {
          expect_oracle_bits(cpumoe_test::output_values(w.d, run_moe(pk, w.d, threads)), exact);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// An E8M0 byte of 255 is NaN: every token routed to that expert gets NaN outputs (the NaN column
// of h reaches the activation's requantization scale), the others are exact.
TEST(MoeW4, Mxfp4NanScalePropagates) {
  W4Data w = make_w4({9, 4, 2, 64, 64}, W4Format::mxfp4, 32, DType::f32, Activation::silu, false,
                     31);
  w.ref.s13[size_t(2 * 2 * 64 * 2 + 5)] = 255;  // expert 2, a group of its w13
  const std::vector<float> exact =
      cpumoe_ref::fused_moe_w4(w.ref, w.d.ref_inputs(), cpumoe::vec::apply);
  int nan_tokens = 0;
  for (int64_t t = 0; t < 9; ++t) nan_tokens += std::isnan(exact[size_t(t * 64)]);
  ASSERT_GT(nan_tokens, 0);
  ASSERT_LT(nan_tokens, 9);
  for (const cpumoe::Q4GemmUkernel* kern : supported_w4_kernels()) {
    SCOPED_TRACE(kern->name);
    const cpumoe::PackedMoeW4 pk(w.weights(), kern);
    expect_oracle_bits(cpumoe_test::output_values(w.d, run_moe(pk, w.d, 2)), exact);
  }
}

// int4 group scales of any sign, zero too (GGUF's Q4_0 stores d < 0 for half of its blocks): the
// oracle's bits on every path.
TEST(MoeW4, NegativeAndZeroInt4ScalesAreValues) {
  W4Data w = make_w4({9, 4, 2, 64, 64}, W4Format::int4, 32, DType::f32, Activation::silu, true,
                     37);
  for (size_t i = 0; i < w.ref.s13.size() / 4; ++i) {
    float v;
    std::memcpy(&v, w.ref.s13.data() + 4 * i, 4);
    v = i % 3 == 0 ? -v : i % 7 == 0 ? 0.0f : v;
    std::memcpy(w.ref.s13.data() + 4 * i, &v, 4);
  }
  for (size_t i = 0; i < w.ref.s2.size() / 4; i += 2) {
    float v;
    std::memcpy(&v, w.ref.s2.data() + 4 * i, 4);
    v = -v;
    std::memcpy(w.ref.s2.data() + 4 * i, &v, 4);
  }
  check_all_w4_paths(w);
}

// The packed layer holds 4 bits per weight plus the group scales (about half of W8A8's bytes).
TEST(MoeW4, PackedBytesAndAccessors) {
  const W4Data w = make_w4({1, 3, 1, 256, 128}, W4Format::int4, 128, DType::f32,
                           Activation::silu, true, 5);
  const W4Data m = make_w4({1, 3, 1, 256, 128}, W4Format::mxfp4, 32, DType::f32,
                           Activation::silu, false, 6);
  for (const cpumoe::Q4GemmUkernel* kern : supported_w4_kernels()) {
    SCOPED_TRACE(kern->name);
    const cpumoe::PackedMoeW4 pk(w.weights(), kern, 2), pm(m.weights(), kern, 2);
    EXPECT_EQ(pk.format(), W4Format::int4);
    EXPECT_EQ(pk.group_size(), 128);
    EXPECT_EQ(pm.format(), W4Format::mxfp4);
    EXPECT_EQ(&pk.kernel(), kern);
    EXPECT_TRUE(pk.has_bias13());
    EXPECT_FALSE(pm.has_bias2());
    const size_t weights = size_t(3) * 3 * 256 * 128;  // E * (2I * H + H * I)
    const size_t bias = size_t(3) * (256 + 256) * 4;
    const size_t pad = size_t(3) * 2 * 4096;  // per-expert alignment and per-block padding
    EXPECT_GE(pk.packed_bytes(), weights / 2 + weights / 128 * 4 + bias);
    EXPECT_LE(pk.packed_bytes(), weights / 2 + weights / 128 * 4 + bias + pad);
    EXPECT_GE(pm.packed_bytes(), weights / 2 + weights / 32);
    EXPECT_LE(pm.packed_bytes(), weights / 2 + weights / 32 + pad);
    // int4_affine: int4's bytes plus an fp32 offset per group (panels of 64 columns: 256 and
    // 256 columns here, no padding), and the accessors of its offsets.
    const W4Data a = make_w4({1, 3, 1, 256, 128}, W4Format::int4_affine, 128, DType::f32,
                             Activation::silu, true, 5);
    const cpumoe::PackedMoeW4 pa(a.weights(), kern, 2);
    EXPECT_EQ(pa.format(), W4Format::int4_affine);
    EXPECT_EQ(pa.weight_format(), cpumoe::WeightFormat::int4_affine);
    EXPECT_EQ(pa.layout().format, W4Format::int4);
    EXPECT_EQ(pa.packed_bytes(), pk.packed_bytes() + weights / 128 * 4);
    EXPECT_EQ(pk.o13(0), nullptr);
    ASSERT_NE(pa.o13(0), nullptr);
    // Expert 1's w2 column 70, group 0: min + 8 scale of its pair.
    const float* pair = reinterpret_cast<const float*>(a.ref.s2.data()) + 2 * (256 + 70);
    EXPECT_EQ(pa.o2(1)[1 * cpumoe::kGroupOffsetPanel + 70 - 64], pair[1] + 8.0f * pair[0]);
    // int8_affine: 8-bit codes (one plane, offset min + 128 scale) where the kernel has them,
    // else two int4 planes (hi: min + 8 * 16 scale; lo: 8 scale, one plane further).
    const W4Data b = make_w4({1, 3, 1, 256, 128}, W4Format::int8_affine, 128, DType::f32,
                             Activation::silu, true, 5);
    const cpumoe::PackedMoeW4 pb(b.weights(), kern, 2);
    EXPECT_EQ(pb.weight_format(), cpumoe::WeightFormat::int8_affine);
    const float* pb2 = reinterpret_cast<const float*>(b.ref.s2.data()) + 2 * (256 + 70);
    const float* o2 = pb.o2(1) + 1 * cpumoe::kGroupOffsetPanel + 70 - 64;
    EXPECT_EQ(o2[0], pb2[1] + 8.0f * (16.0f * pb2[0]));
    if (kern->codes8) {
      EXPECT_EQ(pb.planes(), 1);
      EXPECT_EQ(pb.layout().format, W4Format::int8_affine);
      EXPECT_EQ(o2[0], pb2[1] + 128.0f * pb2[0]);
      // 8 bits per weight and the same scales and offsets as int4_affine.
      EXPECT_GE(pb.packed_bytes(), pa.packed_bytes() + weights / 2);
      EXPECT_LE(pb.packed_bytes(), pa.packed_bytes() + weights / 2 + pad);
    } else {
      EXPECT_EQ(pb.planes(), 2);
      EXPECT_EQ(pb.layout().format, W4Format::int4);
      EXPECT_EQ(pb.packed_bytes(), 2 * pa.packed_bytes() - bias);
      EXPECT_EQ(o2[cpumoe::group_offset_floats(256, 128, 128)], 8.0f * pb2[0]);
    }
  }
}

TEST(MoeW4, ScratchBoundHolds) {
  const W4Data w = make_w4({300, 8, 4, 128, 64}, W4Format::int4, 64, DType::bf16,
                           Activation::gelu, false, 8);
  const cpumoe::PackedMoeW4 pk(w.weights());
  cpumoe::release_thread_scratch();
  run_moe(pk, w.d, 2);
  EXPECT_GT(cpumoe::thread_scratch_bytes(), 0u);
  EXPECT_LE(cpumoe::thread_scratch_bytes(), cpumoe::fused_moe_scratch_bytes(pk, 300, 4, 2));
  // The kernel's bound covers every layout a 128 x 64 layer can have (group 32 or 64, mxfp4).
  EXPECT_LE(cpumoe::fused_moe_scratch_bytes(pk, 300, 4, 2),
            cpumoe::fused_moe_scratch_bytes(pk.kernel(), 8, 128, 64, 300, 4, 2));
}

// A kernel that takes more scratch than the one it wraps needs, and writes all of it: the
// wrapped kernel's scratch_bytes (first, so that it stays 64-byte aligned), then a part that
// grows with m, n and k / group. Every block it is handed is recorded.
namespace greedy {
const cpumoe::Q4GemmUkernel* inner = nullptr;
std::mutex mu;
std::map<const uint8_t*, size_t> blocks;  // start -> the most bytes asked there
int bad_pointers = 0;                     // null or not 64-byte aligned where bytes were due

size_t extra(int64_t m, int64_t n, int64_t k, const cpumoe::W4Layout& w) {
  return m > 0 && n > 0 ? size_t(40 * m + 4 * n + 8 * (k / w.group)) : 0;
}
size_t scratch_bytes(int64_t m, int64_t n, int64_t k, const cpumoe::W4Layout& w) {
  return inner->scratch_bytes(m, n, k, w) + extra(m, n, k, w);
}
void run_f32(int64_t m, int64_t n, int64_t k, const cpumoe::W4Layout& w, const void* lhs,
             const void* rhs, float* dst, int64_t dst_stride, const cpumoe::Q4GemmEpilogue& ep) {
  const size_t bytes = scratch_bytes(m, n, k, w);
  auto* p = static_cast<uint8_t*>(ep.scratch);
  if (bytes > 0) {
    {
      const std::lock_guard<std::mutex> lock(mu);
      if (p == nullptr || reinterpret_cast<uintptr_t>(p) % 64 != 0) {
        ++bad_pointers;
        return;
      }
      size_t& most = blocks[p];
      most = std::max(most, bytes);
    }
    std::memset(p, 0x5a, bytes);  // what a kernel may do: the garbage must hurt nobody
  }
  inner->run_f32(m, n, k, w, lhs, rhs, dst, dst_stride, ep);
}
}  // namespace greedy

// The scratch the dispatcher plans covers what the kernels are given: with the greedy kernel
// above over every kernel this CPU runs, decode and prefill, each phase structure, 1-3 threads,
// every block handed out is 64-byte aligned, lies in the calling thread's scratch block (at most
// fused_moe_scratch_bytes), blocks of different threads never overlap, and the results (which
// the garbage would spoil if a block overlapped a live buffer) are the oracle's bits.
TEST(MoeW4, KernelScratchIsPlannedPerThread) {
  for (const Fmt& fm : {Fmt{W4Format::int4, 32}, Fmt{W4Format::int4, 128},
                        Fmt{W4Format::mxfp4, 32}, Fmt{W4Format::int8_affine, 32}}) {
    for (const cpumoe_test::MoeShape& s :
         {cpumoe_test::MoeShape{1, 8, 4, 256, 128}, cpumoe_test::MoeShape{150, 4, 2, 128, 256}}) {
      const W4Data w = make_w4(s, fm.f, fm.g, DType::bf16, Activation::silu, true, 77);
      Oracle oracle(w);
      for (const cpumoe::Q4GemmUkernel* kern : supported_w4_kernels()) {
        const std::vector<float>& exact = oracle(kern);
        greedy::inner = kern;
        cpumoe::Q4GemmUkernel kg = *kern;
        kg.scratch_bytes = greedy::scratch_bytes;
        kg.run_f32 = greedy::run_f32;
        for (int fuse : {2, 1, 0}) {
          cpumoe::MoeConfig<cpumoe::Q4GemmUkernel> cfg = cpumoe::w4_config(&kg);
          cfg.tiles.fuse_gemm1 = fuse > 0;
          cfg.tiles.fuse_gemm2 = fuse > 1;
          cfg.tiles.rows = 24;  // several row chunks per expert at prefill
          const cpumoe::PackedMoeW4 pk(w.weights(), cfg, 1);
          for (int threads : {1, 2, 3}) {
            SCOPED_TRACE(testing::Message()
                         << kern->name << " " << cpumoe::w4_format_name(fm.f) << " g=" << fm.g
                         << " T=" << s.T << " fuse=" << fuse << " threads=" << threads);
            greedy::blocks.clear();
            greedy::bad_pointers = 0;
            cpumoe::release_thread_scratch();  // the block is then this call's plan exactly
            const std::vector<uint8_t> raw = run_moe(pk, w.d, threads);
            ASSERT_EQ(greedy::bad_pointers, 0) << "a call got no or misaligned scratch";
            ASSERT_FALSE(greedy::blocks.empty());
            ASSERT_LE(greedy::blocks.size(), size_t(threads)) << "one block per thread";
            const size_t cap = cpumoe::thread_scratch_bytes();
            const uint8_t* base = cpumoe::moe_detail::thread_scratch().reserve(0, 0);
            ASSERT_LE(cap, cpumoe::fused_moe_scratch_bytes(pk, s.T, s.k, threads));
            const uint8_t* end = base;
            for (const auto& [p, bytes] : greedy::blocks) {
              ASSERT_GE(p, end) << "blocks overlap (or start before the scratch block)";
              end = p + bytes;
              ASSERT_LE(end, base + cap) << "a block runs past the calling thread's scratch";
            }
            expect_oracle_bits(cpumoe_test::output_values(w.d, raw), exact);
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

// Each bad input is an ArgumentError whose message starts with the argument's name.
TEST(MoeW4, BadWeightsAreArgumentErrors) {
  const W4Data base = make_w4({1, 2, 1, 64, 64}, W4Format::int4, 32, DType::f32,
                              Activation::silu, false, 9);
  auto expect_bad = [](const cpumoe::MoeWeightsW4& mw, const char* prefix) {
    try {
      const cpumoe::PackedMoeW4 pk(mw);
      ADD_FAILURE() << prefix << ": accepted";
    } catch (const ArgumentError& e) {
      EXPECT_EQ(std::string(e.what()).rfind(prefix, 0), 0u) << e.what();
    }
  };
  {
    W4Data w = base;
    w.v13[77] = 8;  // outside [-8, 7]
    expect_bad(w.weights(), "w13: int4 values must be in [-8, 7] (element 77 is 8)");
    w = base;
    w.v2[3] = -9;
    expect_bad(w.weights(), "w2: int4 values");
  }
  {
    cpumoe::MoeWeightsW4 mw = base.weights();
    mw.group_size = 48;
    expect_bad(mw, "group_size");
    mw.group_size = 0;
    expect_bad(mw, "group_size");
    mw.group_size = 2 * cpumoe::kW4MaxGroup;
    expect_bad(mw, "group_size: at most");
    mw.group_size = 128;  // does not divide H = 64
    expect_bad(mw, "w13: hidden size");
  }
  {
    W4Data w = make_w4({1, 2, 1, 128, 96}, W4Format::int4, 32, DType::f32, Activation::silu,
                       false, 10);
    cpumoe::MoeWeightsW4 mw = w.weights();
    mw.group_size = 64;  // divides H = 128, not I = 96
    expect_bad(mw, "w2: intermediate size");
  }
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {  // 0 and negative ones are values
    W4Data w = base;
    std::memcpy(w.ref.s13.data() + 4 * 5, &bad, 4);
    expect_bad(w.weights(), "s13");
  }
  {
    cpumoe::MoeWeightsW4 mw = base.weights();
    mw.s2 = nullptr;
    expect_bad(mw, "s2: missing");
    mw = base.weights();
    mw.w13 = nullptr;
    expect_bad(mw, "w13: missing");
    mw = base.weights();
    mw.format = W4Format(7);
    expect_bad(mw, "format");
  }
  {
    W4Data m = make_w4({1, 2, 1, 64, 64}, W4Format::mxfp4, 32, DType::f32, Activation::silu,
                       false, 11);
    cpumoe::MoeWeightsW4 mw = m.weights();
    mw.group_size = 64;
    expect_bad(mw, "group_size: mxfp4");
  }
  {  // int4_affine: codes in [0, 15]; scales and mins finite, and min + 8 scale too
    const W4Data a = make_w4({1, 2, 1, 64, 64}, W4Format::int4_affine, 32, DType::f32,
                             Activation::silu, false, 12);
    W4Data w = a;
    w.v13[5] = 16;
    expect_bad(w.weights(), "w13: int4_affine codes must be in [0, 15] (element 5 is 16)");
    w = a;
    w.v2[9] = -1;  // the byte 255
    expect_bad(w.weights(), "w2: int4_affine codes must be in [0, 15] (element 9 is 255)");
    for (int at : {0, 1}) {  // the scale, then the min, of pair 3
      w = a;
      const float bad = std::nanf("");
      std::memcpy(w.ref.s2.data() + 8 * 3 + 4 * at, &bad, 4);
      expect_bad(w.weights(), "s2: every scale must be finite");
    }
    w = a;
    const float pair[2] = {3e38f, 1e38f};  // 8 * 3e38 + 1e38 overflows
    std::memcpy(w.ref.s13.data() + 8 * 4, pair, 8);
    expect_bad(w.weights(), "s13: min + 8 * scale overflows fp32 at group 4");
  }
  {  // int8_affine: every byte a code; each plane's scale (16 scale) and offsets finite
    const W4Data a = make_w4({1, 2, 1, 64, 64}, W4Format::int8_affine, 32, DType::f32,
                             Activation::silu, false, 13);
    W4Data w = a;
    w.v13[5] = -1;  // the code 255
    EXPECT_NO_THROW(cpumoe::PackedMoeW4 pk(w.weights()));
    const float pair[2] = {3e37f, 0.0f};  // 16 * 3e37 overflows
    std::memcpy(w.ref.s2.data() + 8 * 2, pair, 8);
    expect_bad(w.weights(), "s2: 16 * scale or min + 128 * scale overflows fp32 at group 2");
    w = a;
    const float pair2[2] = {1e36f, 3.3e38f};  // min + 128 scale overflows
    std::memcpy(w.ref.s13.data() + 8 * 1, pair2, 8);
    expect_bad(w.weights(), "s13: 16 * scale or min + 128 * scale overflows fp32 at group 1");
  }
}

}  // namespace
