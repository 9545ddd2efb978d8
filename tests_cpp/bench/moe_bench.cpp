// cpumoe_moe_bench: runs the fused MoE op on one problem, for timing natively and for counting
// instructions under qemu (../shared/tools/qemu-insn-count). The timed region is bracketed by
// getppid() calls, which the counter turns into "mark" lines; subtract two marks for one region.
//
//   cpumoe_moe_bench [--H 2048] [--I 768] [--E 128] [--k 8] [--T 16] [--iters 3]
//                    [--act silu] [--isa CAP] [--threads N]
// Prints the kernel used, ms per call and the SMMLA floor of the routing (see PERF.md).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpumoe/moe.h"

int main(int argc, char** argv) {
  int64_t H = 2048, I = 768, E = 128, k = 8, T = 16, iters = 3;
  int threads = 0;
  std::string act = "silu", isa;
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
    else if (a == "--act") act = v;
    else if (a == "--isa") isa = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  cpumoe::Activation activation;
  if (!cpumoe::parse_activation(act.c_str(), &activation)) {
    std::fprintf(stderr, "unknown activation %s\n", act.c_str());
    return 2;
  }
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> w8(-127, 127);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<int8_t> w13(size_t(E * 2 * I * H)), w2(size_t(E * H * I));
  for (auto& v : w13) v = int8_t(w8(rng));
  for (auto& v : w2) v = int8_t(w8(rng));
  std::vector<float> s13(size_t(E * 2 * I), 1e-3f), s2(size_t(E * H), 1e-3f);
  std::vector<float> x(size_t(T * H)), out(size_t(T * H));
  for (auto& v : x) v = nd(rng);
  // Distinct experts per token, like a router's top-k.
  std::vector<int32_t> ids(size_t(T * k));
  std::vector<float> tw(size_t(T * k), 1.0f / float(k));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) perm[size_t(e)] = int32_t(e);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < k; ++j) ids[size_t(t * k + j)] = perm[size_t(j % E)];
  }

  cpumoe::MoeWeights w;
  w.num_experts = E;
  w.hidden = H;
  w.intermediate = I;
  w.w13 = w13.data();
  w.w2 = w2.data();
  w.s13 = s13.data();
  w.s2 = s2.data();
  const cpumoe::QGemmUkernel* kern = nullptr;
  if (!isa.empty()) {
    const cpumoe::Isa cap = cpumoe::parse_isa(isa, "--isa");
    kern = cpumoe::qgemm_select(&cap);
  }
  cpumoe::PackedMoe packed(w, kern, threads);

  cpumoe::MoeCall c;
  c.num_tokens = T;
  c.topk = k;
  c.x = x.data();
  c.x_row_stride = H;
  c.dtype = cpumoe::DType::f32;
  c.topk_weights = tw.data();
  c.topk_weights_row_stride = k;
  c.topk_ids = ids.data();
  c.topk_ids_row_stride = k;
  c.activation = activation;
  c.out = out.data();
  c.out_row_stride = H;
  c.num_threads = threads;

  cpumoe::fused_moe_int8(packed, c);  // warm-up: page faults, lazy set-up
  getppid();                          // mark: start of the measured calls
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) cpumoe::fused_moe_int8(packed, c);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  getppid();                          // mark: end

  // The SMMLA floor of this routing: sum_e ceil(m_e / 2) * (2I*H/16 + H*I/16) per call.
  std::vector<int64_t> m(static_cast<size_t>(E), 0);
  for (int32_t e : ids) ++m[size_t(e)];
  int64_t floor_smmla = 0;
  for (int64_t me : m) floor_smmla += (me + 1) / 2 * (2 * I * H / 16 + H * I / 16);
  std::printf("kernel %s T %lld H %lld I %lld E %lld k %lld iters %lld ms/call %.3f "
              "smmla_floor/call %lld\n",
              packed.kernel().name, (long long)T, (long long)H, (long long)I, (long long)E,
              (long long)k, (long long)iters, s * 1e3 / double(iters), (long long)floor_smmla);
  return 0;
}
