// cpumoe_moe_bench: runs the fused MoE op on one problem, for timing natively and for counting
// instructions under qemu (tests_cpp/bench/qemu_plugin). The timed region is bracketed by
// getppid() calls, which the counter turns into "mark" lines; subtract two marks for one region.
//
//   cpumoe_moe_bench [--H 2048] [--I 768] [--E 128] [--k 8] [--T 16] [--iters 3]
//                    [--act SPEC, e.g. silu or silu_clamp(limit=10)] [--dtype f32|bf16|f16]
//                    [--isa CAP] [--threads N] [--phases 0|1] [--tasks 0|1]
//                    [--format int8|int4|int4_affine|int8_affine|mxfp4|bf16|fp8|w4a16]
//                    [--group G]
//                    [--fuse 0|1|2]
//                    [--routings N]
//
// --fuse: the tile policy's fusion (0 phase by phase, 1 GEMM1 + activation in row tasks, 2 GEMM2
// in them too; default the policy's own). --routings N: the measured calls cycle through N random
// routings (N > 1 reads other experts' weights each call: cold weights at decode).
// --format int4 / mxfp4: the W4A8 op (PackedMoeW4) on 4-bit weights made from the same random
// bytes (int4: the top four bits of each int8, groups of G k, default 128; mxfp4: the bytes as
// E2M1 code pairs, E8M0 scales near 2^-7). --format bf16: the BF16 op on the bytes times 2^-10 in
// bf16; fp8: the BF16 op on FP8 weights (PackedMoeFp8), the bytes as E4M3 codes (NaN codes
// replaced by zero), one fp32 scale per G x G block (G = --group, default 128); w4a16: the FP8
// op on 4-bit codes (the bytes' low nibbles into int4's codebook, (1, G) blocks: the W4A16 mode).
// Prints the kernel used, ms per call, the routing (active experts, largest m_e) and the SMMLA
// floor of the routing (PERF.md: sum_e ceil(m_e / 2) * (2I*H/16 + H*I/16) per call).
// Marks: one before and one after the `iters` measured calls. With --phases 1 (a build with
// -DCPUMOE_BENCH_HOOKS=ON), `iters` more calls follow in which the dispatcher marks every phase;
// the bench then prints `phase_seq ...`, the phase of each of those marks in order (names in the
// `phases` line), and one final mark closes them. tests_cpp/bench/arm_perf_table.sh reads all of it.
// With --tasks 1 (hooks build), prints per phase the tasks (and the GEMM tasks' multiply-adds over
// the kernel's padded tiles, "macs") each thread ran over the measured calls.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "../../csrc/moe/bench_hooks.h"  // internal to the dispatcher: bench-only
#include "cpumoe/moe.h"
#include "reference/reference.h"  // e4m3_code (the w4a16 codebook)

namespace {

// Random int8 in [-127, 127], 8 bytes per step of a xorshift (the weights are hundreds of MB, and
// under qemu a per-byte std::uniform_int_distribution costs more than the whole measurement).
void fill_int8(std::vector<int8_t>& v, uint64_t seed) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  size_t i = 0;
  for (; i + 8 <= v.size(); i += 8) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    std::memcpy(&v[i], &s, 8);
  }
  for (; i < v.size(); ++i) v[i] = int8_t(i);
  for (auto& x : v) x = x == -128 ? int8_t(-127) : x;
}

// --fuse: -1 keeps the policy's default.
void set_fusion(cpumoe::MoeTilePolicy* tp, int64_t fuse) {
  if (fuse < 0) return;
  tp->fuse_gemm1 = fuse > 0;
  tp->fuse_gemm2 = fuse > 1;
}

std::vector<int> g_phase_seq;
std::vector<std::chrono::steady_clock::time_point> g_phase_time;  // natively: wall time per phase
bool g_recording = false;

void on_phase(int phase) {
  if (!g_recording) return;
  g_phase_seq.push_back(phase);
  g_phase_time.push_back(std::chrono::steady_clock::now());
  getppid();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t H = 2048, I = 768, E = 128, k = 8, T = 16, iters = 3;
  int threads = 0;
  bool phases = false, tasks = false;
  std::string act = "silu", isa, dtype = "f32", format = "int8";
  int64_t group = 128, fuse = -1, routings = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--H") H = std::atoll(v);
    else if (a == "--I") I = std::atoll(v);
    else if (a == "--E") E = std::atoll(v);
    else if (a == "--k") k = std::atoll(v);
    else if (a == "--T") T = std::atoll(v);
    else if (a == "--iters") iters = std::atoll(v);
    else if (a == "--threads") threads = std::atoi(v);
    else if (a == "--act" || a == "--activation") act = v;
    else if (a == "--dtype") dtype = v;
    else if (a == "--isa") isa = v;
    else if (a == "--phases") phases = std::atoi(v) != 0;
    else if (a == "--tasks") tasks = std::atoi(v) != 0;
    else if (a == "--format") format = v;
    else if (a == "--group") group = std::atoll(v);
    else if (a == "--fuse") fuse = std::atoll(v);
    else if (a == "--routings") routings = std::max<int64_t>(1, std::atoll(v));
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  cpumoe::ActivationSpec activation;  // a spec: "silu", "silu_clamp(limit=10)", ...
  std::string why;
  if (!cpumoe::parse_activation_spec(act, &activation, &why) ||
      !(why = cpumoe::activation_spec_problem(activation)).empty()) {
    std::fprintf(stderr, "activation: %s\n", why.c_str());
    return 2;
  }
  cpumoe::DType dt;
  if (dtype == "f32") dt = cpumoe::DType::f32;
  else if (dtype == "bf16") dt = cpumoe::DType::bf16;
  else if (dtype == "f16") dt = cpumoe::DType::f16;
  else {
    std::fprintf(stderr, "unknown dtype %s (f32, bf16, f16)\n", dtype.c_str());
    return 2;
  }
#if !defined(CPUMOE_BENCH_HOOKS)
  if (phases || tasks) {
    std::fprintf(stderr, "--phases / --tasks need a build with -DCPUMOE_BENCH_HOOKS=ON\n");
    return 2;
  }
#endif
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<int8_t> w13(size_t(E * 2 * I * H)), w2(size_t(E * H * I));
  fill_int8(w13, 1);
  fill_int8(w2, 2);
  std::vector<float> s13(size_t(E * 2 * I), 1e-3f), s2(size_t(E * H), 1e-3f);
  const size_t es = size_t(cpumoe::dtype_size(dt));
  std::vector<uint8_t> x(size_t(T * H) * es), out(size_t(T * H) * es);
  for (int64_t i = 0; i < T * H; ++i) {
    const float v = nd(rng);
    if (dt == cpumoe::DType::f32) std::memcpy(&x[size_t(i) * 4], &v, 4);
    else {
      const uint16_t h = dt == cpumoe::DType::bf16 ? cpumoe::f32_to_bf16(v) : cpumoe::f32_to_f16(v);
      std::memcpy(&x[size_t(i) * 2], &h, 2);
    }
  }
  // Distinct experts per token, like a router's top-k; `routings` such routings one after another.
  std::vector<int32_t> all_ids(size_t(routings * T * k));
  std::vector<float> tw(size_t(T * k), 1.0f / float(k));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < routings * T; ++t) {
    for (int64_t e = 0; e < E; ++e) perm[size_t(e)] = int32_t(e);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < k; ++j) all_ids[size_t(t * k + j)] = perm[size_t(j % E)];
  }
  const std::vector<int32_t> ids(all_ids.begin(), all_ids.begin() + T * k);  // the first

  const cpumoe::Isa cap = isa.empty() ? cpumoe::Isa::portable : cpumoe::parse_isa(isa, "--isa");
  const cpumoe::Isa* capp = isa.empty() ? nullptr : &cap;
  // The rest of the run, on the packed layer of either op.
  auto measure = [&](const auto& packed) -> int {
    // The op of the packed layer's weight format: int8 activations or bf16 (bf16, fp8 weights).
    auto run_op = [](const auto& p, const cpumoe::MoeCall& call) {
      using P = std::decay_t<decltype(p)>;
      if constexpr (std::is_same_v<P, cpumoe::PackedMoeBf16> ||
                    std::is_same_v<P, cpumoe::PackedMoeFp8>)
        cpumoe::fused_moe_bf16(p, call);
      else
        cpumoe::fused_moe_int8(p, call);
    };
    cpumoe::MoeCall c;
    c.num_tokens = T;
    c.topk = k;
    c.x = x.data();
    c.x_row_stride = H;
    c.dtype = dt;
    c.topk_weights = tw.data();
    c.topk_weights_row_stride = k;
    c.topk_ids = ids.data();
    c.topk_ids_row_stride = k;
    c.activation = activation;
    c.out = out.data();
    c.out_row_stride = H;
    c.num_threads = threads;

    run_op(packed, c);  // warm-up: page faults, lazy set-up
  #if defined(CPUMOE_BENCH_HOOKS)
    cpumoe::bench_hooks::reset_tasks();
  #endif
    getppid();                          // mark: start of the measured calls
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iters; ++i) {
      c.topk_ids = all_ids.data() + (i % routings) * T * k;
      run_op(packed, c);
    }
    c.topk_ids = ids.data();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    getppid();                          // mark: end
  #if defined(CPUMOE_BENCH_HOOKS)
    if (phases) {
      g_phase_seq.reserve(size_t(iters * (T * k * 3 + 64)));
      cpumoe::bench_hooks::set_single_thread(threads == 1);
      cpumoe::bench_hooks::set_phase_callback(on_phase);
      g_recording = true;
      for (int64_t i = 0; i < iters; ++i) run_op(packed, c);
      g_recording = false;
      g_phase_time.push_back(std::chrono::steady_clock::now());
      getppid();                        // mark: end of the phase-marked calls
      cpumoe::bench_hooks::set_phase_callback(nullptr);
    }
  #endif

    // The SMMLA floor of this routing: sum_e ceil(m_e / 2) * (2I*H/16 + H*I/16) per call.
    std::vector<int64_t> m(static_cast<size_t>(E), 0);
    for (int32_t e : ids) ++m[size_t(e)];
    int64_t floor_smmla = 0, active = 0, max_m = 0;
    for (int64_t me : m) {
      floor_smmla += (me + 1) / 2 * (2 * I * H / 16 + H * I / 16);
      active += me > 0;
      max_m = std::max(max_m, me);
    }
    std::printf("kernel %s T %lld H %lld I %lld E %lld k %lld act %s dtype %s iters %lld "
                "ms/call %.3f active_experts %lld max_rows %lld smmla_floor/call %lld\n",
                packed.kernel().name, (long long)T, (long long)H, (long long)I, (long long)E,
                (long long)k, act.c_str(), dtype.c_str(), (long long)iters, s * 1e3 / double(iters),
                (long long)active, (long long)max_m, (long long)floor_smmla);
    // Histogram of the rows per active expert: "rows_hist m_e:experts ...".
    std::vector<int64_t> hist(static_cast<size_t>(max_m + 1), 0);
    for (int64_t me : m) ++hist[size_t(me)];
    std::printf("rows_hist");
    for (int64_t r = 1; r <= max_m; ++r)
      if (hist[size_t(r)] > 0) std::printf(" %lld:%lld", (long long)r, (long long)hist[size_t(r)]);
    std::printf("\n");
  #if defined(CPUMOE_BENCH_HOOKS)
    namespace bh = cpumoe::bench_hooks;
    if (phases) {
      std::printf("phases");
      for (int p = 0; p < bh::num_phases; ++p) std::printf(" %d:%s", p, bh::phase_name(p));
      std::printf("\nphase_seq");
      for (int p : g_phase_seq) std::printf(" %d", p);
      // Wall ms per call of each phase (meaningful natively, not under qemu): a phase lasts from its
      // mark to the next one.
      std::vector<double> ms(size_t(bh::num_phases), 0.0);
      for (size_t i = 0; i + 1 < g_phase_time.size() && i < g_phase_seq.size(); ++i)
        ms[size_t(g_phase_seq[i])] +=
            std::chrono::duration<double, std::milli>(g_phase_time[i + 1] - g_phase_time[i]).count();
      std::printf("\nphase_ms_per_call");
      for (int p = 0; p < bh::num_phases; ++p)
        std::printf(" %s:%.3f", bh::phase_name(p), ms[size_t(p)] / double(iters));
      std::printf("\n");
    }
    if (tasks) {
      const int nt = std::min(bh::kMaxThreads, threads > 0 ? threads : bh::kMaxThreads);
      for (int p = 0; p < bh::num_phases; ++p) {
        int64_t total = 0;
        for (int t = 0; t < nt; ++t) total += bh::tasks(p, t);
        if (total == 0) continue;
        std::printf("tasks %-10s", bh::phase_name(p));
        for (int t = 0; t < nt; ++t) {
          if (bh::tasks(p, t) == 0 && threads <= 0) continue;
          std::printf(" t%d=%lld", t, (long long)bh::tasks(p, t));
          if (bh::work(p, t) > 0) std::printf("(%lld macs)", (long long)bh::work(p, t));
        }
        std::printf("\n");
      }
    }
  #endif
    return 0;
  };
  // The shape every weight struct has.
  auto shaped = [&](auto w) {
    w.num_experts = E;
    w.hidden = H;
    w.intermediate = I;
    return w;
  };
  if (format == "int8") {
    auto w = shaped(cpumoe::MoeWeights{});
    w.w13 = w13.data();
    w.w2 = w2.data();
    w.s13 = s13.data();
    w.s2 = s2.data();
    auto cfg = cpumoe::int8_config(capp ? cpumoe::qgemm_select(capp) : nullptr);
    set_fusion(&cfg.tiles, fuse);
    cpumoe::PackedMoe packed(w, cfg, threads);
    std::vector<int8_t>().swap(w13);  // the unpacked copies are not needed any more
    std::vector<int8_t>().swap(w2);
    return measure(packed);
  }
  if (format == "bf16" || format == "fp8" || format == "w4a16") {
    try {
      if (format == "bf16") {
        std::vector<uint16_t> b13(w13.size()), b2(w2.size());
        for (size_t i = 0; i < w13.size(); ++i) b13[i] = cpumoe::f32_to_bf16(w13[i] / 1024.0f);
        for (size_t i = 0; i < w2.size(); ++i) b2[i] = cpumoe::f32_to_bf16(w2[i] / 1024.0f);
        std::vector<int8_t>().swap(w13);
        std::vector<int8_t>().swap(w2);
        auto w = shaped(cpumoe::MoeWeightsBf16{});
        w.w13 = b13.data();
        w.w2 = b2.data();
        auto cfg = cpumoe::bf16_config(capp ? cpumoe::bgemm_select(capp) : nullptr);
        set_fusion(&cfg.tiles, fuse);
        cpumoe::PackedMoeBf16 packed(w, cfg, threads);
        std::vector<uint16_t>().swap(b13);
        std::vector<uint16_t>().swap(b2);
        return measure(packed);
      }
      // w4a16: 4-bit codes (the bytes' low nibbles) into int4's codebook -8..7, (1, group)
      // blocks, as prepack_int4(act_quant="bf16") makes them.
      const bool w4 = format == "w4a16";
      uint8_t book[16];
      for (int i = 0; i < 16; ++i) book[i] = cpumoe_ref::e4m3_code(float(i - 8));  // exact
      for (auto* v : {&w13, &w2})
        for (auto& x : *v)
          x = w4 ? int8_t(x & 15) : (uint8_t(x) & 0x7F) == 0x7F ? int8_t(0) : x;  // no NaN codes
      const int64_t bn = w4 ? 1 : group;
      auto blocks = [&](int64_t n, int64_t kk) {
        return size_t(E * ((n + bn - 1) / bn) * ((kk + group - 1) / group));
      };
      std::vector<float> f13(blocks(2 * I, H), 1e-3f), f2(blocks(H, I), 1e-3f);
      auto w = shaped(cpumoe::MoeWeightsFp8{});
      w.block_n = bn;
      w.block_k = group;
      if (w4) {
        w.code_bits = 4;
        w.codebook = book;
      }
      w.w13 = reinterpret_cast<const uint8_t*>(w13.data());
      w.w2 = reinterpret_cast<const uint8_t*>(w2.data());
      w.s13 = f13.data();
      w.s2 = f2.data();
      auto cfg = cpumoe::fp8_config(capp ? cpumoe::f8gemm_select(capp) : nullptr);
      set_fusion(&cfg.tiles, fuse);
      cpumoe::PackedMoeFp8 packed(w, cfg, threads);
      std::vector<int8_t>().swap(w13);
      std::vector<int8_t>().swap(w2);
      std::printf("format %s block %lldx%lld code_bits %lld packed_bytes %zu\n", format.c_str(),
                  (long long)bn, (long long)group, (long long)packed.code_bits(),
                  packed.packed_bytes());
      return measure(packed);
    } catch (const cpumoe::ArgumentError& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 2;
    }
  }
  if (format != "int4" && format != "int4_affine" && format != "int8_affine" &&
      format != "mxfp4") {
    std::fprintf(stderr,
                 "unknown format %s (int8, int4, int4_affine, int8_affine, mxfp4, bf16, fp8)\n",
                 format.c_str());
    return 2;
  }
  const bool mx = format == "mxfp4", bytes = format == "int8_affine";
  const bool affine = format == "int4_affine" || bytes;
  if (mx) group = 32;
  auto w = shaped(cpumoe::MoeWeightsW4{});
  w.format = mx       ? cpumoe::W4Format::mxfp4
             : bytes  ? cpumoe::W4Format::int8_affine
             : affine ? cpumoe::W4Format::int4_affine
                      : cpumoe::W4Format::int4;
  w.group_size = group;
  if (!mx && !bytes)  // int4: in [-8, 7]; int4_affine: codes in [0, 15]; int8_affine: any byte
    for (auto* v : {&w13, &w2})
      for (auto& x : *v) x = affine ? int8_t(uint8_t(x) >> 4) : int8_t(x >> 4);
  // int4: fp32 group scales; the affine formats: (scale, min) pairs (min -8.5 scales, 8-bit:
  // -136 sixteenths); mxfp4: E8M0 bytes (2^-7 ... 2^-5).
  const int64_t groups13 = E * 2 * I * (H / group), groups2 = E * H * (I / group);
  const size_t per = affine ? 2 : 1;
  std::vector<float> g13(size_t(mx ? 0 : groups13) * per, 16e-3f),
      g2(size_t(mx ? 0 : groups2) * per, 16e-3f);
  if (affine)
    for (auto* g : {&g13, &g2})
      for (size_t i = 0; i < g->size(); i += 2) {
        if (bytes) (*g)[i] = 1e-3f;
        (*g)[i + 1] = -8.5f * 16e-3f;
      }
  std::vector<uint8_t> e13(size_t(mx ? groups13 : 0)), e2(size_t(mx ? groups2 : 0));
  for (size_t i = 0; i < e13.size(); ++i) e13[i] = uint8_t(120 + i % 3);
  for (size_t i = 0; i < e2.size(); ++i) e2[i] = uint8_t(120 + i % 3);
  w.w13 = w13.data();
  w.w2 = w2.data();
  w.s13 = mx ? static_cast<const void*>(e13.data()) : g13.data();
  w.s2 = mx ? static_cast<const void*>(e2.data()) : g2.data();
  try {
    auto cfg = cpumoe::w4_config(capp ? cpumoe::q4gemm_select(capp) : nullptr);
    set_fusion(&cfg.tiles, fuse);
    cpumoe::PackedMoeW4 packed(w, cfg, threads);
    std::vector<int8_t>().swap(w13);
    std::vector<int8_t>().swap(w2);
    std::printf("format %s group %lld packed_bytes %zu\n", format.c_str(), (long long)group,
                packed.packed_bytes());
    return measure(packed);
  } catch (const cpumoe::ArgumentError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}