// Reliability of the dispatcher: 64-bit size and offset arithmetic at sizes beyond 2^31, a seeded
// random-shape fuzz against the oracle, determinism across thread counts and repeated calls,
// non-finite inputs, the scratch bound and its reuse, aliasing of out, thread-count capping,
// size products that overflow, and ids rewritten by another thread during calls (the hammer:
// CPUMOE_HAMMER_CALLS calls per caller, default 2000).
//
// The fuzz runs CPUMOE_FUZZ_CASES cases (default kDefaultFuzzCases, CI-fast) from seed
// CPUMOE_FUZZ_SEED (default 1); a nightly-style run is
//   CPUMOE_FUZZ_CASES=10000 cpumoe_reliability_test --gtest_filter=Fuzz.*
// A real call whose intermediate buffer exceeds 2^31 bytes (about 4.5 GB of memory, seconds) runs
// only with CPUMOE_BIG_TESTS=1 (see tests_cpp/CMakeLists.txt).
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../csrc/moe/parallel.h"
#include "cpumoe/moe.h"
#include "moe_test_util.h"
#include "reference/reference.h"

namespace {

using cpumoe::Activation;
using cpumoe::DType;
using cpumoe_test::make_moe_data;
using cpumoe_test::MoeData;
using cpumoe_test::MoeShape;
using u128 = unsigned __int128;

// Same tolerance and reasoning as test_moe.cpp's kMoeTol (the double oracle differs from the
// library only in the activation's last bits; the bitwise check against the oracle with the
// library's activation forms is the strict one).
constexpr double kMoeTol = 2e-2;
// CI-fast: about 0.6 s natively for 3 kernels x 3 thread counts. Under qemu-user (QEMU_CPU is set
// by ci/test_all.sh's cross stage, which runs the suite on 3 CPU models) a case costs 30-60 times
// more, so fewer cases there; the nightly-style run sets CPUMOE_FUZZ_CASES.
constexpr int kDefaultFuzzCases = 150;
constexpr int kDefaultFuzzCasesUnderQemu = 40;
constexpr int kThreadCounts[] = {1, 2, 4};

std::string str(u128 v) {
  std::string out;
  do {
    out.insert(out.begin(), char('0' + int(v % 10)));
    v /= 10;
  } while (v != 0);
  return out;
}

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoll(v) : fallback;
}

// ---------------------------------------------------------------------------- int64 offsets
// The kernels' size/offset functions at sizes whose products exceed 2^31 (and 2^32), checked
// against 128-bit arithmetic. Packed layouts are tiles: the offset of row (column) tile a is
// a times the offset of tile 1, and a packed buffer of m rows holds every tile before m; both
// sizes are affine in the padded depth. A 32-bit product anywhere breaks these relations.
TEST(Int64Offsets, KernelSizeFunctionsAreExactBeyond2To31) {
  for (const cpumoe::QGemmUkernel* kp : cpumoe_test::supported_kernels()) {
    const cpumoe::QGemmUkernel& kern = *kp;
    SCOPED_TRACE(kern.name);
    const int64_t depth = 4096;  // a multiple of every kr
    struct Side {
      const char* what;
      int64_t tile;
      size_t (*size)(int64_t, int64_t);
      size_t (*offset)(int64_t, int64_t);
    };
    for (const Side& s : {Side{"lhs", kern.mr, kern.lhs_packed_size, kern.lhs_packed_offset},
                          Side{"rhs", kern.nr, kern.rhs_packed_size, kern.rhs_packed_offset}}) {
      SCOPED_TRACE(s.what);
      const u128 one = s.offset(s.tile, depth);
      ASSERT_TRUE(one >= u128(s.tile) * u128(depth)) << "a tile holds at least its elements";
      for (int64_t a : {int64_t(1) << 20, (int64_t(1) << 31) / s.tile + 3, int64_t(1) << 33}) {
        const int64_t idx = a * s.tile;  // > 2^31 rows for the last two
        const u128 want = u128(a) * one;
        ASSERT_LT(want, u128(std::numeric_limits<size_t>::max()));
        const u128 off = s.offset(idx, depth), size = s.size(idx, depth);
        EXPECT_TRUE(off == want) << "offset of index " << idx << ": " << str(off) << ", want "
                                 << str(want);
        EXPECT_TRUE(size >= want && size <= want + one)
            << "size of " << idx << " rows/columns: " << str(size) << ", want " << str(want);
      }
      // Depth beyond 2^31: affine in the depth (k1 is a multiple of every kr).
      const int64_t k1 = (int64_t(1) << 31) + (int64_t(1) << 20);
      const u128 f1 = s.size(s.tile, k1), f2 = s.size(s.tile, 2 * k1), f3 = s.size(s.tile, 3 * k1);
      EXPECT_TRUE(f1 >= u128(s.tile) * u128(k1)) << str(f1);
      EXPECT_TRUE(f3 - f2 == f2 - f1) << "size not affine in the depth beyond 2^31";
      EXPECT_TRUE(u128(s.offset(8 * s.tile, 2 * k1)) == 8 * u128(s.offset(s.tile, 2 * k1)));
    }
  }
}

// The W4A8 family's packed-B sizes and offsets, which depend on the format and group too: exact
// beyond 2^31 columns and depths; and its scratch bound at huge T (shared planner): one chunk.
TEST(Int64Offsets, W4SizesAndScratchBeyond2To31) {
  for (const cpumoe::Q4GemmUkernel* kp : cpumoe::q4gemm_registry()) {
    if (!cpumoe::cpu_supports(kp->isa)) continue;
    SCOPED_TRACE(kp->name);
    for (const cpumoe::W4Layout w : {cpumoe::W4Layout{cpumoe::W4Format::int4, 32},
                                     cpumoe::W4Layout{cpumoe::W4Format::int4, 128},
                                     cpumoe::W4Layout{cpumoe::W4Format::mxfp4, 32}}) {
      const int64_t depth = 4096;
      const u128 one = kp->rhs_packed_offset(kp->nr, depth, w);
      ASSERT_TRUE(one >= u128(kp->nr) * u128(depth) / 2) << "a block holds its 4-bit codes";
      for (int64_t a : {int64_t(1) << 20, (int64_t(1) << 31) / kp->nr + 3, int64_t(1) << 33}) {
        const int64_t idx = a * kp->nr;
        const u128 want = u128(a) * one;
        EXPECT_TRUE(u128(kp->rhs_packed_offset(idx, depth, w)) == want) << idx;
        const u128 size = kp->rhs_packed_size(idx, depth, w);
        EXPECT_TRUE(size >= want && size <= want + one) << idx << ": " << str(size);
      }
      const int64_t k1 = (int64_t(1) << 31) + (int64_t(1) << 20);  // a multiple of every group
      const u128 f1 = kp->rhs_packed_size(kp->nr, k1, w), f2 = kp->rhs_packed_size(kp->nr, 2 * k1, w),
                 f3 = kp->rhs_packed_size(kp->nr, 3 * k1, w);
      EXPECT_TRUE(f1 >= u128(kp->nr) * u128(k1) / 2) << str(f1);
      EXPECT_TRUE(f3 - f2 == f2 - f1) << "size not affine in the depth beyond 2^31";
    }
    for (int64_t T : {int64_t(65536), int64_t(1) << 40}) {
      const size_t got = cpumoe::fused_moe_scratch_bytes(*kp, 128, 2048, 768, T, 8, 4);
      EXPECT_GE(got, size_t(16384) * 2048 * 4) << "GEMM2's output of one chunk";
      EXPECT_EQ(got, cpumoe::fused_moe_scratch_bytes(*kp, 128, 2048, 768, 2 * T, 8, 4));
    }
  }
}

// The scratch planner at sizes no machine here could run: every intermediate buffer is at least
// what the formulas say (no wrap-around), the bound stops growing after one chunk, and it is
// exact to within the per-expert padding allowance.
TEST(Int64Offsets, ScratchPlannerBeyond2To32) {
  for (const cpumoe::QGemmUkernel* kp : cpumoe_test::supported_kernels()) {
    SCOPED_TRACE(kp->name);
    struct Big {
      int64_t E, H, I, T, k;
    };
    for (const Big& b : {Big{128, 2048, 768, 65536, 8}, Big{256, 16384, 16384, 10000000, 8},
                         Big{8, int64_t(1) << 20, int64_t(1) << 20, 1 << 20, 2},
                         Big{4, 8, 8, int64_t(1) << 40, 1}}) {
      SCOPED_TRACE(testing::Message() << "E=" << b.E << " H=" << b.H << " I=" << b.I << " T="
                                      << b.T << " k=" << b.k);
      const int threads = 4;
      const size_t got =
          cpumoe::fused_moe_scratch_bytes(*kp, b.E, b.H, b.I, b.T, b.k, threads);
      // One chunk of at most 16384 slots.
      const u128 tc = u128(std::min<int64_t>(b.T, std::max<int64_t>(1, 16384 / b.k)));
      const u128 P = tc * u128(b.k), H = u128(b.H), I = u128(b.I);
      // Packed A rows are padded to the kernel's kr (64 for AMX: 8 columns take 64 bytes).
      const u128 Hp = u128(cpumoe::round_up(b.H, kp->kr)), Ip = u128(cpumoe::round_up(b.I, kp->kr));
      // Phases 1-5 (h fp32, qa, xq, packed lhs1 at >= 1 byte per element) share their space
      // with GEMM2's output y (fp32); packed lhs2 and the routing come on top.
      const u128 route = 2 * P * 8;                           // pos_of, token_of
      const u128 early = P * 2 * I * 4 + P * I + tc * H + P * H;
      const u128 y = P * H * 4;
      const u128 floor_bytes = route + std::max(early, y) + P * I;
      EXPECT_TRUE(u128(got) >= floor_bytes) << got << " < " << str(floor_bytes);
      // Slack: 64-byte alignment of ~25 buffers, the per-expert padding of the packed rows (one
      // tile of mr rows each, 2 bytes per element at most), task lists, per-thread rows, scales.
      const u128 experts = std::min<u128>(u128(b.E), P);
      const u128 slack = 25 * 64 + experts * (u128(kp->mr) * 2 * (Hp + Ip) + 128 + 4 * 8) +
                         threads * (H + I) * 4 + P * 16 + (P / 256 + experts + 16) *
                         ((2 * I + H) / 256 + 8) * 40 + (u128(1) << 20);
      // A call of fewer slots may fuse GEMM2 into GEMM1's row tasks, its y (at most 2 MiB)
      // then apart from phases 1-5's buffers.
      const u128 y_apart = std::min<u128>(y, u128(2) << 20);
      const u128 ceiling =
          route + std::max(early + P * Hp + y_apart, y) + 2 * P * Ip + slack;  // lhs <= 2 B
      EXPECT_TRUE(u128(got) <= ceiling) << got << " > " << str(ceiling);
      if (b.H >= 16384) {
        EXPECT_GT(got, size_t(1) << (b.H >= (1 << 20) ? 36 : 31));
      }
      // Constant beyond one chunk; non-decreasing before.
      EXPECT_EQ(got, cpumoe::fused_moe_scratch_bytes(*kp, b.E, b.H, b.I, b.T * 2, b.k, threads));
      const int64_t fewer = std::max<int64_t>(1, b.T / 3);
      EXPECT_GE(got, cpumoe::fused_moe_scratch_bytes(*kp, b.E, b.H, b.I, fewer, b.k, threads));
    }
    EXPECT_EQ(cpumoe::fused_moe_scratch_bytes(*kp, 4, 16, 16, 0, 2), 0u);
    EXPECT_THROW(cpumoe::fused_moe_scratch_bytes(*kp, 4, 16, 16, -1, 2), cpumoe::ArgumentError);
    EXPECT_THROW(cpumoe::fused_moe_scratch_bytes(*kp, 4, 16, 16, 1, 0), cpumoe::ArgumentError);
  }
}

// Anonymous memory that is only reserved: untouched pages cost nothing, so row strides of 2^29
// elements (row offsets beyond 2^31 elements and 2^32 bytes) can be real.
class Sparse {
 public:
  explicit Sparse(size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    p_ = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
  }
  ~Sparse() {
    if (p_ != nullptr) munmap(p_, bytes_);
  }
  Sparse(const Sparse&) = delete;
  Sparse& operator=(const Sparse&) = delete;
  uint8_t* get() const { return p_; }

 private:
  uint8_t* p_;
  size_t bytes_;
};

// A real call whose x, out, topk_ids and topk_weights rows sit beyond 2^31 elements (2^32 bytes)
// from their first row: the same bits as the dense call.
TEST(Int64Offsets, RowStridesBeyond2To31Elements) {
  MoeData d = make_moe_data({5, 4, 2, 64, 32}, DType::bf16, Activation::silu, true, 401);
  const cpumoe::PackedMoe pk(d.weights());
  const std::vector<uint8_t> dense = cpumoe_test::run_moe(pk, d, 2);

  const int64_t T = d.s.T, H = d.s.H, k = d.s.k;
  const int64_t sx = (int64_t(1) << 29) + 8, so = (int64_t(1) << 29) + 16;  // elements
  const int64_t si = (int64_t(1) << 29) + 1, sw = (int64_t(1) << 29) + 3;
  ASSERT_GT((T - 1) * sx, int64_t(1) << 31);
  Sparse x(size_t(((T - 1) * sx + H) * d.es())), out(size_t(((T - 1) * so + H) * d.es()));
  Sparse ids(size_t(((T - 1) * si + k) * 8)), w(size_t(((T - 1) * sw + k) * 4));
  if (!x.get() || !out.get() || !ids.get() || !w.get())
    GTEST_SKIP() << "cannot reserve ~40 GB of address space here (mmap MAP_NORESERVE failed)";
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(x.get() + t * sx * d.es(), d.x.data() + t * d.x_stride * d.es(),
                size_t(H * d.es()));
    std::memcpy(ids.get() + t * si * 8, d.ids.data() + t * d.id_stride, size_t(k * 8));
    std::memcpy(w.get() + t * sw * 4, d.topk_w.data() + t * d.w_stride, size_t(k * 4));
  }
  cpumoe::MoeCall c = cpumoe_test::make_call(d, out.get(), ids.get(), true, 2);
  c.x = x.get();
  c.x_row_stride = sx;
  c.out_row_stride = so;
  c.topk_ids_row_stride = si;
  c.topk_weights = reinterpret_cast<const float*>(w.get());
  c.topk_weights_row_stride = sw;
  cpumoe::fused_moe_int8(pk, c);
  for (int64_t t = 0; t < T; ++t)
    EXPECT_EQ(std::memcmp(out.get() + t * so * d.es(), dense.data() + t * d.out_stride * d.es(),
                          size_t(H * d.es())),
              0)
        << "token " << t << " (row offset " << t * so << " elements)";
}

// Reads MemAvailable from /proc/meminfo (bytes), 0 if unknown.
int64_t mem_available() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

// A real call whose GEMM2 output buffer y [P, H] fp32 is 2.15e9 bytes (> 2^31): P = 16384 slots
// (one chunk), H = 32776. Checked on sampled tokens (the last ones sit past byte 2^31 of y)
// against single-token calls, bit for bit, and against the oracle with the library's activation
// forms, bit for bit. About 4.5 GB and a few seconds on 2 cores; opt-in with CPUMOE_BIG_TESTS=1.
TEST(Int64Offsets, BigIntermediateBufferRealRun) {
  if (env_int("CPUMOE_BIG_TESTS", 0) != 1) GTEST_SKIP() << "set CPUMOE_BIG_TESTS=1 to run";
  if (mem_available() < (int64_t(7) << 30)) GTEST_SKIP() << "needs 7 GB of available memory";
  const int64_t T = 8192, E = 2, k = 2, H = 32776, I = 8;
  ASSERT_GT(T * k * H * 4, int64_t(1) << 31);
  // Small weights; the big inputs are filled directly (make_moe_data's normal draws: too slow).
  const MoeData base = make_moe_data({1, E, k, H, I}, DType::bf16, Activation::gelu, true, 402);
  MoeData d = base;
  d.s.T = T;
  d.x_stride = H;
  d.out_stride = H;
  d.w_stride = k;
  d.id_stride = k;
  d.x.assign(size_t(T * H * 2), 0);
  uint32_t state = 12345;
  auto* x16 = reinterpret_cast<uint16_t*>(d.x.data());
  for (int64_t i = 0; i < T * H; ++i) {  // cheap LCG: values in [-4, 4)
    state = state * 1664525u + 1013904223u;
    x16[i] = cpumoe::f32_to_bf16(float(int32_t(state >> 8) - (1 << 23)) * (4.0f / (1 << 23)));
  }
  d.ids.assign(size_t(T * k), 0);
  d.topk_w.assign(size_t(T * k), 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    d.ids[size_t(t * k)] = t % 2;
    d.ids[size_t(t * k + 1)] = 1 - t % 2;
    d.topk_w[size_t(t * k)] = 0.75f;
    d.topk_w[size_t(t * k + 1)] = 0.25f;
  }
  const cpumoe::PackedMoe pk(d.weights());
  std::vector<uint8_t> out(size_t(T * H * 2), 0);
  const size_t bound = cpumoe::fused_moe_scratch_bytes(pk, T, k, 2);
  const auto t0 = std::chrono::steady_clock::now();
  cpumoe::fused_moe_int8(pk, cpumoe_test::make_call(d, out.data(), d.ids.data(), true, 2));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LE(cpumoe::thread_scratch_bytes(), bound);
  std::cout << "[ big run ] T=" << T << " k=" << k << " H=" << H << " I=" << I << " kernel "
            << pk.kernel().name << ": " << secs << " s, scratch " << cpumoe::thread_scratch_bytes()
            << " bytes (bound " << bound << ")" << std::endl;

  std::vector<int64_t> sample = {0, 1, 2, 4095, 4096, T / 2 + 1};
  for (int64_t t = T - 8; t < T; ++t) sample.push_back(t);
  for (int64_t t : sample) {
    SCOPED_TRACE(testing::Message() << "token " << t);
    MoeData one = base;  // the weights, with the inputs of token t alone
    one.x_stride = one.out_stride = H;
    one.w_stride = one.id_stride = k;
    one.x.assign(d.x.begin() + t * H * 2, d.x.begin() + (t + 1) * H * 2);
    one.ids.assign(d.ids.begin() + t * k, d.ids.begin() + (t + 1) * k);
    one.topk_w.assign(d.topk_w.begin() + t * k, d.topk_w.begin() + (t + 1) * k);
    const std::vector<uint8_t> single = cpumoe_test::run_moe(pk, one, 1);
    ASSERT_EQ(std::memcmp(single.data(), out.data() + t * H * 2, size_t(H * 2)), 0);
    const std::vector<float> exact =
        cpumoe_ref::fused_moe(one.ref, one.ref_inputs(), cpumoe::vec::apply);
    const std::vector<float> got = cpumoe_test::output_values(one, single);
    ASSERT_EQ(std::memcmp(got.data(), exact.data(), size_t(H) * 4), 0);
  }
}

// ---------------------------------------------------------------------------- fuzz
enum class Routing { uniform, all_on_one, first_slot_on_one, skewed, two_experts, expert_map };
const char* routing_name(Routing r) {
  const char* names[] = {"uniform", "all_on_one", "first_slot_on_one", "skewed", "two_experts",
                         "expert_map"};
  return names[int(r)];
}

struct FuzzCase {
  MoeData d;
  Routing routing = Routing::uniform;
  std::vector<int32_t> expert_map;  // empty: none; else [G], entries in [-1, E)
  bool ids_int64 = true;
};

// One random case from rng: small shapes (CI-fast, also under qemu), every dtype, activation,
// bias dtype, skip_weighted, k > E, and the routings above.
FuzzCase random_case(std::mt19937_64& rng, uint32_t seed) {
  auto pick = [&rng](int64_t lo, int64_t hi) {  // inclusive
    return lo + int64_t(rng() % uint64_t(hi - lo + 1));
  };
  const int64_t r = pick(0, 99);
  const int64_t T = r < 5 ? 0 : r < 30 ? pick(1, 3) : r < 85 ? pick(4, 40) : r < 97 ? pick(41, 120)
                                                                                   : pick(257, 300);
  const int64_t E = pick(0, 9) == 0 ? pick(17, 64) : pick(1, 16);
  const int64_t k = E <= 8 && pick(0, 6) == 0 ? pick(E + 1, std::min<int64_t>(E + 4, 10))
                                              : pick(1, std::min<int64_t>(E, 8));
  // Mostly H, I <= 64; some up to 192; small when T is large (the oracle is naive loops).
  auto dim = [&]() {
    return 8 * (T > 120 ? pick(1, 4) : pick(0, 9) == 0 ? pick(9, 24) : pick(1, 8));
  };
  const int64_t H = dim(), I = dim();
  const auto dtype = DType(pick(0, 2));
  const auto act = Activation(pick(0, 3));
  const bool bias = pick(0, 1) == 1;
  FuzzCase fc;
  fc.d = make_moe_data({T, E, k, H, I}, dtype, act, bias, seed, DType(pick(0, 2)));
  MoeData& d = fc.d;
  d.skip_weighted = k == 1 && pick(0, 2) == 0;
  fc.ids_int64 = pick(0, 1) == 1;
  fc.routing = Routing(pick(0, 5));
  const int64_t e0 = pick(0, E - 1);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      int64_t& id = d.ids[size_t(t * d.id_stride + j)];
      switch (fc.routing) {
        case Routing::uniform: break;  // distinct per token when k <= E
        case Routing::all_on_one: id = e0; break;
        case Routing::first_slot_on_one:
          if (j == 0) id = e0;
          break;
        case Routing::skewed: {  // a power law: expert 0 gets most slots
          const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
          id = std::min<int64_t>(E - 1, int64_t(double(E) * u * u * u));
          break;
        }
        case Routing::two_experts: id = (t + j) % 3 == 0 ? e0 : (e0 + 1) % E; break;
        case Routing::expert_map: break;
      }
    }
  }
  if (fc.routing == Routing::expert_map) {  // G global experts, about half of them here
    const int64_t G = E + pick(1, 2 * E);
    fc.expert_map.assign(size_t(G), -1);
    std::vector<int32_t> locals(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) locals[size_t(e)] = int32_t(e);
    std::shuffle(locals.begin(), locals.end(), rng);
    for (int64_t e = 0; e < E; ++e)
      if (pick(0, 3) != 0) fc.expert_map[size_t(pick(0, G - 1))] = locals[size_t(e)];
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j) d.ids[size_t(t * d.id_stride + j)] = pick(0, G - 1);
  }
  return fc;
}

// The op on every supported kernel and on 1, 2 and 4 threads; returns the common output and
// fails the test if any two runs differ. Also checks the scratch held stays within the bound.
std::vector<uint8_t> run_everywhere(const FuzzCase& fc) {
  const MoeData& d = fc.d;
  std::vector<int32_t> ids32(d.ids.begin(), d.ids.end());
  std::vector<uint8_t> first;
  std::string first_name;
  for (const cpumoe::QGemmUkernel* kern : cpumoe_test::supported_kernels()) {
    const cpumoe::PackedMoe pk(d.weights(), kern);
    for (int threads : kThreadCounts) {
      std::vector<uint8_t> out(size_t(std::max<int64_t>(1, d.s.T * d.out_stride) * d.es()),
                               cpumoe_test::kOutPattern);
      cpumoe::MoeCall c = cpumoe_test::make_call(
          d, out.data(), fc.ids_int64 ? static_cast<const void*>(d.ids.data()) : ids32.data(),
          fc.ids_int64, threads);
      if (!fc.expert_map.empty()) {
        c.expert_map = fc.expert_map.data();
        c.num_global_experts = int64_t(fc.expert_map.size());
      }
      cpumoe::release_thread_scratch();
      cpumoe::fused_moe_int8(pk, c);
      EXPECT_LE(cpumoe::thread_scratch_bytes(),
                cpumoe::fused_moe_scratch_bytes(pk, d.s.T, d.s.k, threads))
          << kern->name << ": scratch above the reported bound";
      const std::string name = std::string(kern->name) + " threads=" + std::to_string(threads);
      if (first.empty()) {
        first = std::move(out);
        first_name = name;
      } else if (out != first) {
        ADD_FAILURE() << name << " differs from " << first_name;
      }
    }
  }
  if (d.s.T == 0) {
    for (uint8_t b : first) EXPECT_EQ(b, cpumoe_test::kOutPattern) << "T = 0 wrote to out";
  }
  return first;
}

// The oracle's view of a case: with an expert map, ids become local and slots held elsewhere
// get weight 0 (adding 0 * y to an fp32 sum is exact, so this is the op's "contributes nothing"
// bit for bit); with skip_weighted the weights are 1.
struct OracleInputs {
  std::vector<int64_t> ids;
  std::vector<float> w;
  cpumoe_ref::MoeInputs in;
};
OracleInputs oracle_inputs(const FuzzCase& fc) {
  const MoeData& d = fc.d;
  OracleInputs o;
  o.in = d.ref_inputs();
  if (fc.expert_map.empty()) return o;
  o.ids = d.ids;
  o.w = d.topk_w;
  for (int64_t t = 0; t < d.s.T; ++t) {
    for (int64_t j = 0; j < d.s.k; ++j) {
      const int32_t local = fc.expert_map[size_t(d.ids[size_t(t * d.id_stride + j)])];
      o.ids[size_t(t * d.id_stride + j)] = local < 0 ? 0 : local;
      o.w[size_t(t * d.w_stride + j)] =
          local < 0 ? 0.0f : (d.skip_weighted ? 1.0f : d.topk_w[size_t(t * d.w_stride + j)]);
    }
  }
  o.in.skip_weighted = false;
  o.in.topk_ids = o.ids.data();
  o.in.topk_weights = o.w.data();
  return o;
}

TEST(Fuzz, RandomShapesMatchOracle) {
  const int64_t cases =
      env_int("CPUMOE_FUZZ_CASES",
              std::getenv("QEMU_CPU") ? kDefaultFuzzCasesUnderQemu : kDefaultFuzzCases);
  const uint64_t seed = uint64_t(env_int("CPUMOE_FUZZ_SEED", 1));
  std::mt19937_64 rng(seed);
  double worst = 0.0;
  int64_t routing_count[6] = {}, slots = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < cases; ++n) {
    const FuzzCase fc = random_case(rng, uint32_t(seed * 1000003u + uint64_t(n)));
    const MoeData& d = fc.d;
    SCOPED_TRACE(testing::Message()
                 << "fuzz case " << n << " (seed " << seed << "): T=" << d.s.T << " E=" << d.s.E
                 << " k=" << d.s.k << " H=" << d.s.H << " I=" << d.s.I << " dtype="
                 << cpumoe::dtype_name(d.dtype) << " act=" << cpumoe_test::spec_name(d.act)
                 << " bias=" << !d.b13_raw.empty() << " skip_weighted=" << d.skip_weighted
                 << " routing=" << routing_name(fc.routing) << " ids_int64=" << fc.ids_int64);
    ++routing_count[int(fc.routing)];
    slots += d.s.T * d.s.k;
    const std::vector<uint8_t> raw = run_everywhere(fc);
    if (HasFailure()) return;
    const std::vector<float> got = cpumoe_test::output_values(d, raw);
    const OracleInputs o = oracle_inputs(fc);
    const std::vector<float> exact = cpumoe_ref::fused_moe(d.ref, o.in, cpumoe::vec::apply);
    ASSERT_EQ(got.size(), exact.size());
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(std::memcmp(&got[i], &exact[i], 4), 0)
          << "element " << i << " (token " << i / size_t(d.s.H) << "): got " << got[i]
          << ", oracle with the library's activation forms " << exact[i];
    worst = std::max(worst, cpumoe_test::expect_close(got, cpumoe_ref::fused_moe(d.ref, o.in),
                                                      kMoeTol));
    if (HasFailure()) return;
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "[ fuzz ] " << cases << " cases (seed " << seed << ", " << slots
            << " slots; routings";
  for (int r = 0; r < 6; ++r)
    std::cout << " " << routing_name(Routing(r)) << "=" << routing_count[r];
  std::cout << ") x " << cpumoe_test::supported_kernels().size() << " kernels x {1,2,4} threads: "
            << "all bit-identical and equal to the oracle; worst error vs the double oracle "
            << worst << " of max|ref|; " << secs << " s" << std::endl;
  RecordProperty("cases", int(cases));
}

// ---------------------------------------------------------------------------- determinism
TEST(Determinism, RepeatedCallsAndThreadCountsGiveTheSameBits) {
  const MoeData d =
      make_moe_data({37, 16, 4, 72, 40}, DType::bf16, Activation::gelu_tanh, true, 403);
  for (const cpumoe::QGemmUkernel* kern : cpumoe_test::supported_kernels()) {
    const cpumoe::PackedMoe pk(d.weights(), kern);
    const std::vector<uint8_t> want = cpumoe_test::run_moe(pk, d, 1);
    for (int rep = 0; rep < 3; ++rep)
      for (int threads : kThreadCounts)
        ASSERT_TRUE(cpumoe_test::run_moe(pk, d, threads) == want)
            << kern->name << " threads=" << threads << " repetition " << rep;
  }
}

// A thread count far above the machine's is capped (libgomp would abort creating a million
// threads) and, like every count, gives the same bits.
TEST(Determinism, HugeThreadCountIsCapped) {
  const MoeData d = make_moe_data({9, 4, 2, 16, 16}, DType::f32, Activation::silu, true, 404);
  const cpumoe::PackedMoe pk(d.weights());
  EXPECT_TRUE(cpumoe_test::run_moe(pk, d, 1 << 30) == cpumoe_test::run_moe(pk, d, 1));
}

// 8 plain threads share one PackedMoe, each with its own inputs and thread count, many times:
// every result equals the serial one (each caller has its own scratch).
TEST(Determinism, ConcurrentCallersGetSerialResults) {
  const cpumoe::PackedMoe pk(make_moe_data({1, 8, 2, 64, 32}, DType::f16, Activation::swigluoai,
                                           true, 405).weights());
  std::vector<MoeData> inputs;
  std::vector<std::vector<uint8_t>> want;
  for (uint32_t i = 0; i < 8; ++i) {
    // Same weights (same seed for them), different T, routing and inputs.
    MoeData d = make_moe_data({int64_t(3 + 11 * i), 8, 2, 64, 32}, DType::f16,
                              Activation::swigluoai, true, 405);
    MoeData other = make_moe_data({int64_t(3 + 11 * i), 8, 2, 64, 32}, DType::f16,
                                  Activation::swigluoai, true, 500 + i);
    d.x = other.x;
    d.ids = other.ids;
    d.topk_w = other.topk_w;
    want.push_back(cpumoe_test::run_moe(pk, d, 1));
    inputs.push_back(std::move(d));
  }
  std::vector<int> bad(8, 0);
  std::vector<std::thread> pool;
  for (int i = 0; i < 8; ++i)
    pool.emplace_back([&, i] {
      for (int rep = 0; rep < 10; ++rep)
        bad[size_t(i)] +=
            cpumoe_test::run_moe(pk, inputs[size_t(i)], 1 + (i + rep) % 2) != want[size_t(i)];
    });
  for (std::thread& t : pool) t.join();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(bad[size_t(i)], 0) << "thread " << i;
}

// ---------------------------------------------------------------------------- non-finite input
// NaN or inf in a token's x makes that token's output all NaN (and only that token's); NaN
// router weights and biases propagate like the oracle's fp32 arithmetic. Compared with the
// oracle element by element: same NaN positions, same bits elsewhere.
void expect_same_as_oracle(const MoeData& d) {
  for (const cpumoe::QGemmUkernel* kern : cpumoe_test::supported_kernels()) {
    SCOPED_TRACE(kern->name);
    const cpumoe::PackedMoe pk(d.weights(), kern);
    const std::vector<float> got = cpumoe_test::output_values(d, cpumoe_test::run_moe(pk, d, 2));
    const std::vector<float> want =
        cpumoe_ref::fused_moe(d.ref, d.ref_inputs(), cpumoe::vec::apply);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::isnan(want[i])) {
        ASSERT_TRUE(std::isnan(got[i])) << "element " << i << ": got " << got[i] << ", want NaN";
      } else {
        ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0)
            << "element " << i << ": got " << got[i] << ", want " << want[i];
      }
    }
  }
}

TEST(NonFinite, NanOrInfInXGivesANanTokenAndNothingElse) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    for (const cpumoe::ActivationSpec& act : cpumoe_test::moe_activation_specs()) {
      SCOPED_TRACE(testing::Message() << cpumoe::dtype_name(dt) << " "
                                      << cpumoe_test::spec_name(act));
      MoeData d = make_moe_data({7, 4, 2, 16, 24}, dt, act, true, 406);
      d.set_x(0, 3, std::nanf(""));
      d.set_x(2, 0, INFINITY);
      d.set_x(3, 15, -INFINITY);
      for (int64_t c = 0; c < d.s.H; ++c) d.set_x(5, c, std::nanf(""));
      expect_same_as_oracle(d);
      const std::vector<float> got =
          cpumoe_test::output_values(d, cpumoe_test::run_moe(cpumoe::PackedMoe(d.weights()), d, 1));
      for (int64_t t = 0; t < d.s.T; ++t) {
        const bool bad = t == 0 || t == 2 || t == 3 || t == 5;
        for (int64_t c = 0; c < d.s.H; ++c)
          ASSERT_EQ(std::isnan(got[size_t(t * d.s.H + c)]), bad)
              << "token " << t << " column " << c;
      }
    }
  }
}

TEST(NonFinite, NanWeightsAndBiasesPropagateLikeTheOracle) {
  MoeData d = make_moe_data({6, 4, 2, 16, 16}, DType::f32, Activation::gelu, true, 407);
  d.topk_w[size_t(1 * d.w_stride)] = std::nanf("");
  d.topk_w[size_t(2 * d.w_stride + 1)] = INFINITY;
  expect_same_as_oracle(d);
  MoeData b = make_moe_data({6, 4, 2, 16, 16}, DType::bf16, Activation::silu, true, 408);
  b.ref.b13[5] = std::nanf("");  // expert 0, gate column 5
  cpumoe_test::MoeData::store(b.b13_raw.data(), b.b13_dtype, 5, std::nanf(""));
  b.ref.b2[size_t(2 * 16 + 3)] = INFINITY;  // expert 2, column 3
  cpumoe_test::MoeData::store(b.b2_raw.data(), b.b2_dtype, 2 * 16 + 3, INFINITY);
  expect_same_as_oracle(b);
}

// Huge finite values stay finite (no overflow in the scale: max |x| / 127).
TEST(NonFinite, HugeFiniteValuesStayFinite) {
  MoeData d = make_moe_data({4, 4, 2, 16, 16}, DType::f32, Activation::silu, false, 409);
  d.set_x(1, 2, 3.0e38f);
  d.set_x(2, 7, -3.0e38f);
  expect_same_as_oracle(d);
}

// ---------------------------------------------------------------------------- scratch
// The calling thread's scratch: none before the first call, within the bound after it, reused
// (not grown) by later calls of the same or smaller size, and released on request.
TEST(Scratch, PerThreadBoundedAndReused) {
  const MoeData big = make_moe_data({200, 8, 4, 64, 48}, DType::bf16, Activation::silu, true, 410);
  const MoeData small = make_moe_data({5, 8, 4, 64, 48}, DType::bf16, Activation::silu, true, 410);
  const cpumoe::PackedMoe pk(big.weights());
  std::thread([&] {
    EXPECT_EQ(cpumoe::thread_scratch_bytes(), 0u) << "a new thread starts without scratch";
    cpumoe_test::run_moe(pk, big, 2);
    const size_t held = cpumoe::thread_scratch_bytes();
    EXPECT_GT(held, 0u);
    EXPECT_LE(held, cpumoe::fused_moe_scratch_bytes(pk, 200, 4, 2));
    for (int i = 0; i < 20; ++i) {
      cpumoe_test::run_moe(pk, i % 2 ? big : small, 2);
      ASSERT_EQ(cpumoe::thread_scratch_bytes(), held) << "call " << i;
    }
    cpumoe::release_thread_scratch();
    EXPECT_EQ(cpumoe::thread_scratch_bytes(), 0u);
    EXPECT_TRUE(cpumoe_test::run_moe(pk, small, 1) == cpumoe_test::run_moe(pk, small, 2));
  }).join();
  // Another thread's scratch is its own: this one's is unaffected by the thread above.
  const size_t mine = cpumoe::thread_scratch_bytes();
  std::thread([&] { cpumoe_test::run_moe(pk, big, 1); }).join();
  EXPECT_EQ(cpumoe::thread_scratch_bytes(), mine);
}

// ---------------------------------------------------------------------------- aliasing
// out must not share memory with any input it is read after being written: x, topk_ids,
// topk_weights, expert_map (later chunks still read them).
TEST(Aliasing, OutOverlappingAnyInputIsRefused) {
  MoeData d = make_moe_data({4, 4, 2, 16, 16}, DType::f32, Activation::silu, false, 411);
  const cpumoe::PackedMoe pk(d.weights());
  const int64_t out_bytes = ((d.s.T - 1) * d.out_stride + d.s.H) * 4;
  auto expect_refused = [&](cpumoe::MoeCall c, const char* what) {
    try {
      cpumoe::fused_moe_int8(pk, c);
      ADD_FAILURE() << "overlap with " << what << " not detected";
    } catch (const cpumoe::ArgumentError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("out: must not overlap " + std::string(what), 0), 0u)
          << e.what();
    }
  };
  std::vector<uint8_t> buf(size_t(out_bytes + 4096), 0);
  // ids inside out's span (as a view of the same storage would be).
  std::vector<int64_t> ids(d.ids);
  std::memcpy(buf.data() + 64, ids.data(), ids.size() * 8);
  cpumoe::MoeCall c = cpumoe_test::make_call(d, buf.data(), buf.data() + 64, true, 1);
  expect_refused(c, "topk_ids");
  std::memcpy(buf.data() + 128, d.topk_w.data(), d.topk_w.size() * 4);
  c = cpumoe_test::make_call(d, buf.data(), d.ids.data(), true, 1);
  c.topk_weights = reinterpret_cast<const float*>(buf.data() + 128);
  expect_refused(c, "topk_weights");
  std::vector<int32_t> map = {0, 1, 2, 3};
  std::memcpy(buf.data() + out_bytes - 8, map.data(), 16);  // straddles out's last bytes
  c = cpumoe_test::make_call(d, buf.data(), d.ids.data(), true, 1);
  c.expert_map = reinterpret_cast<const int32_t*>(buf.data() + out_bytes - 8);
  c.num_global_experts = 4;
  expect_refused(c, "expert_map");
  // Right after out's last element: no overlap.
  c.expert_map = reinterpret_cast<const int32_t*>(buf.data() + out_bytes);
  std::memcpy(buf.data() + out_bytes, map.data(), 16);
  EXPECT_NO_THROW(cpumoe::fused_moe_int8(pk, c));
}

// ---------------------------------------------------------------------------- size products
// Absurd sizes (a malformed checkpoint's shapes) are ArgumentErrors naming the argument, never a
// wrapped product and a small allocation.
void expect_argument_error(const std::function<void()>& f, const std::string& prefix) {
  try {
    f();
    ADD_FAILURE() << "no ArgumentError (want one starting with '" << prefix << "')";
  } catch (const cpumoe::ArgumentError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(prefix, 0), 0u) << e.what();
  }
}

TEST(SizeProducts, OverflowingSizesAreArgumentErrors) {
  const int64_t big = int64_t(1) << 40;
  for (const cpumoe::QGemmUkernel* kp : cpumoe_test::supported_kernels()) {
    SCOPED_TRACE(kp->name);
    // 2^40: huge but representable (about 2^56 bytes), so an exact answer, not an error.
    EXPECT_GT(cpumoe::fused_moe_scratch_bytes(*kp, 4, big, big, 1000, 8), size_t(1) << 55);
    expect_argument_error(
        [&] { cpumoe::fused_moe_scratch_bytes(*kp, 4, big << 10, big << 10, 1000, 8); },
        "scratch: ");
    expect_argument_error(
        [&] { cpumoe::fused_moe_scratch_bytes(*kp, 4, int64_t(1) << 62, 8, 1000, 8); },
        "scratch: ");
  }
  // Weights whose element count overflows: refused before any pointer is read (these point at a
  // few bytes only).
  std::vector<int8_t> w(64);
  std::vector<float> sc(64, 1.0f);
  cpumoe::MoeWeights mw;
  mw.w13 = w.data();
  mw.w2 = w.data();
  mw.s13 = sc.data();
  mw.s2 = sc.data();
  for (auto [E, H, I] : {std::array<int64_t, 3>{big, big, 8}, {8, big, big},
                         {int64_t(1) << 60, 8, 8}, {3, int64_t(1) << 61, int64_t(1) << 61}}) {
    SCOPED_TRACE(testing::Message() << "E=" << E << " H=" << H << " I=" << I);
    mw.num_experts = E;
    mw.hidden = H;
    mw.intermediate = I;
    expect_argument_error([&] { cpumoe::PackedMoe p(mw); }, "w");
    cpumoe::MoeWeightsBf16 bw;
    std::vector<uint16_t> wb(64);
    bw.num_experts = E;
    bw.hidden = H;
    bw.intermediate = I;
    bw.w13 = wb.data();
    bw.w2 = wb.data();
    expect_argument_error([&] { cpumoe::PackedMoeBf16 p(bw); }, "w");
  }
  // Row strides whose spans overflow int64 (the overlap check computes them).
  MoeData d = make_moe_data({4, 4, 2, 16, 16}, DType::f32, Activation::silu, false, 412);
  const cpumoe::PackedMoe pk(d.weights());
  std::vector<uint8_t> out(size_t(d.s.T * d.out_stride * 4));
  for (const char* what : {"x", "out", "topk_ids", "topk_weights"}) {
    cpumoe::MoeCall c = cpumoe_test::make_call(d, out.data(), d.ids.data(), true, 1);
    const int64_t huge = int64_t(1) << 62;
    const std::string w = what;
    if (w == "x") c.x_row_stride = huge;
    if (w == "out") c.out_row_stride = huge;
    if (w == "topk_ids") c.topk_ids_row_stride = huge;
    if (w == "topk_weights") c.topk_weights_row_stride = huge;
    expect_argument_error([&] { cpumoe::fused_moe_int8(pk, c); }, w + ": ");
  }
}

// ---------------------------------------------------------------------------- the hammer
// One thread rewrites topk_ids (and the expert map) with random values, in and out of range,
// while two callers run the int8 and the bf16 op on them, with and without an expert map: every
// call returns or throws ArgumentError; nothing reads out of bounds (the ASan build of ci's
// sanitize stage runs this). The writer stores with relaxed atomics; the op's plain reads race with
// them on purpose, as a Python thread rewriting a tensor does.
TEST(Hammer, IdsRewrittenDuringCallsGiveResultsOrArgumentErrors) {
  // Fewer under qemu-user (the cross stage runs the suite on 3 CPU models, 30-60 times slower).
  const int64_t calls = env_int("CPUMOE_HAMMER_CALLS", std::getenv("QEMU_CPU") ? 300 : 2000);
  const int64_t E = 16, G = 24;  // local and global experts
  MoeData d = make_moe_data({64, E, 4, 64, 32}, DType::bf16, Activation::silu, true, 413);
  const cpumoe::PackedMoe pk(d.weights());
  std::vector<uint16_t> w13(d.ref.w13.size()), w2(d.ref.w2.size());
  for (size_t i = 0; i < w13.size(); ++i) w13[i] = cpumoe::f32_to_bf16(d.ref.w13[i] * 1e-3f);
  for (size_t i = 0; i < w2.size(); ++i) w2[i] = cpumoe::f32_to_bf16(d.ref.w2[i] * 1e-3f);
  cpumoe::MoeWeightsBf16 bw;
  bw.num_experts = E;
  bw.hidden = d.s.H;
  bw.intermediate = d.s.I;
  bw.w13 = w13.data();
  bw.w2 = w2.data();
  const cpumoe::PackedMoeBf16 pk16(bw);
  std::vector<int32_t> ids(d.ids.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(std::max<int64_t>(0, d.ids[i]));
  std::vector<int32_t> emap(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) emap[size_t(g)] = g % 3 == 2 ? -1 : int32_t(g % E);

  // The writer makes one id (and now and then one map entry) wrong for a moment, then restores
  // it: most calls see valid ids at validation, some see one change under them.
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    std::mt19937 rng(414);
    std::uniform_int_distribution<int32_t> wild(-5, int32_t(E) + 1000000);
    std::uniform_int_distribution<size_t> id_at(0, ids.size() - 1), map_at(0, emap.size() - 1);
    std::uniform_int_distribution<int32_t> valid(0, int32_t(E) - 1);
    auto pause = [&] {
      for (int n = int(rng() % 2000); n > 0 && !stop.load(std::memory_order_relaxed); --n)
        std::atomic_signal_fence(std::memory_order_seq_cst);
    };
    while (!stop.load(std::memory_order_relaxed)) {
      const size_t i = id_at(rng), m = map_at(rng);
      const int32_t keep = __atomic_load_n(&ids[i], __ATOMIC_RELAXED);
      const int32_t keep_m = __atomic_load_n(&emap[m], __ATOMIC_RELAXED);
      const bool hit_map = rng() % 4 == 0;
      __atomic_store_n(&ids[i], wild(rng), __ATOMIC_RELAXED);
      if (hit_map) __atomic_store_n(&emap[m], wild(rng), __ATOMIC_RELAXED);
      pause();
      __atomic_store_n(&ids[i], rng() % 2 ? keep : valid(rng), __ATOMIC_RELAXED);
      if (hit_map) __atomic_store_n(&emap[m], keep_m, __ATOMIC_RELAXED);
      pause();
    }
  });
  struct Tally {
    int64_t ok = 0, argument_errors = 0, changed = 0, other = 0;
  };
  std::vector<Tally> tally(2);
  auto caller = [&](int which) {
    const MoeData local = d;  // own x and out; shared ids and map
    std::vector<uint8_t> out(size_t(d.s.T * d.out_stride * d.es()));
    for (int64_t i = 0; i < calls; ++i) {
      cpumoe::MoeCall c = cpumoe_test::make_call(local, out.data(), ids.data(), false, 1);
      if (i % 2) {
        c.expert_map = emap.data();
        c.num_global_experts = G;
      }
      try {
        if (which == 0) cpumoe::fused_moe_int8(pk, c);
        else cpumoe::fused_moe_bf16(pk16, c);
        ++tally[size_t(which)].ok;
      } catch (const cpumoe::ArgumentError& e) {
        ++tally[size_t(which)].argument_errors;
        // Caught by the check of the copy, after validation passed.
        tally[size_t(which)].changed += std::strstr(e.what(), "changed by another thread") != nullptr;
      } catch (...) {
        ++tally[size_t(which)].other;
      }
    }
  };
  std::thread a(caller, 0), b(caller, 1);
  a.join();
  b.join();
  stop = true;
  writer.join();
  for (int w = 0; w < 2; ++w) {
    SCOPED_TRACE(w == 0 ? "int8" : "bf16");
    EXPECT_EQ(tally[size_t(w)].ok + tally[size_t(w)].argument_errors, calls);
    EXPECT_EQ(tally[size_t(w)].other, 0);
    std::cout << "[ hammer ] " << (w == 0 ? "int8" : "bf16") << ": " << tally[size_t(w)].ok
              << " returned, " << tally[size_t(w)].argument_errors << " ArgumentError ("
              << tally[size_t(w)].changed << " of them from the check of the copy)\n";
  }
}

}  // namespace

// An item that throws inside the parallel loop (a bad_alloc while packing, say) reaches the caller
// as that exception, once, instead of ending the process from inside the OpenMP region; the loop
// stays usable afterwards.
TEST(ParallelFor, AnItemsExceptionReachesTheCaller) {
  for (int threads : {1, 2, 3}) {
    std::atomic<int64_t> ran{0};
    EXPECT_THROW(cpumoe::moe_detail::parallel_for(64, threads,
                                                  [&](int64_t i, int) {
                                                    ran.fetch_add(1);
                                                    if (i == 17 || i == 40) throw std::bad_alloc();
                                                  }),
                 std::bad_alloc)
        << threads << " threads";
    EXPECT_GE(ran.load(), 18) << "items before the throw ran";
    std::atomic<int64_t> sum{0};
    cpumoe::moe_detail::parallel_for(64, threads, [&](int64_t i, int) { sum.fetch_add(i); });
    EXPECT_EQ(sum.load(), 64 * 63 / 2);
  }
}
