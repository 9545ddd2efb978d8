// q4gemm_insn_bench: the GEMM kernel calls of one MoE layer, W8A8 (a qgemm kernel) against W4A8 (a
// q4gemm kernel), for counting instructions under qemu (tools/qemu-insn-count) or timing natively.
//
//   cpumoe_q4gemm_insn_bench [--H 2048] [--I 768] [--E 128] [--topk 8] [--T 1] [--iters 2]
//                       [--qgemm NAME] [--q4gemm NAME] [--format int4|mxfp4] [--group 128]
//
// Routes T tokens to topk distinct experts each (a fixed seed), and for every expert with m_e > 0
// rows runs GEMM1 (m_e x 2I x H) and GEMM2 (m_e x H x I) of the chosen kernel on packed weights
// (one expert's weights serve all: the instruction counts do not depend on the values) and packed
// activations; packing is outside the counted region. Per kernel it prints one line and brackets
// `iters` layer calls with getppid() (a qemu-insn-count mark): marks 2k+1, 2k+2 hold contender
// k's region (contender 0: the qgemm kernel, 1: the q4gemm kernel). Also prints the SMMLA floor
// of the routing (PERF.md) and the packed weight bytes of each format.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpumoe/q4gemm.h"
#include "cpumoe/qgemm.h"

namespace {

struct Args {
  int64_t H = 2048, I = 768, E = 128, topk = 8, T = 1, iters = 2, group = 128;
  std::string qgemm = "qgemm_qs8p8x8_qs8cp8x8_8x8_neon_i8mm";
  std::string q4gemm = "q4gemm_qs8p8x8_q4cpo8x8_8x8_neon_i8mm";
  std::string format = "int4";
};

// One GEMM of the layer: packed A (rows of the expert), packed B, output.
struct Gemm {
  int64_t n, k;
  std::vector<uint8_t> rhs;
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string o = argv[i], v = argv[i + 1];
    if (o == "--H") a.H = std::atoll(v.c_str());
    else if (o == "--I") a.I = std::atoll(v.c_str());
    else if (o == "--E") a.E = std::atoll(v.c_str());
    else if (o == "--topk") a.topk = std::atoll(v.c_str());
    else if (o == "--T") a.T = std::atoll(v.c_str());
    else if (o == "--iters") a.iters = std::atoll(v.c_str());
    else if (o == "--group") a.group = std::atoll(v.c_str());
    else if (o == "--qgemm") a.qgemm = v;
    else if (o == "--q4gemm") a.q4gemm = v;
    else if (o == "--format") a.format = v;
    else { std::fprintf(stderr, "unknown option %s\n", o.c_str()); return 2; }
  }
  const cpumoe::QGemmUkernel* qk = cpumoe::qgemm_find(a.qgemm.c_str());
  const cpumoe::Q4GemmUkernel* q4 = cpumoe::q4gemm_find(a.q4gemm.c_str());
  if (qk == nullptr || q4 == nullptr) {
    std::fprintf(stderr, "kernel not compiled in\n");
    return 2;
  }
  cpumoe::W4Layout w;
  w.format = a.format == "mxfp4" ? cpumoe::W4Format::mxfp4 : cpumoe::W4Format::int4;
  w.group = w.format == cpumoe::W4Format::mxfp4 ? 32 : a.group;

  // Routing: T tokens, topk distinct experts each.
  std::mt19937 rng(1234);
  std::vector<int64_t> me(size_t(a.E), 0);
  for (int64_t t = 0; t < a.T; ++t) {
    std::vector<int64_t> ids(size_t(a.E));
    for (int64_t e = 0; e < a.E; ++e) ids[size_t(e)] = e;
    for (int64_t x = 0; x < a.topk; ++x) {
      std::uniform_int_distribution<int64_t> d(x, a.E - 1);
      std::swap(ids[size_t(x)], ids[size_t(d(rng))]);
      ++me[size_t(ids[size_t(x)])];
    }
  }
  int64_t mmax = 0, floor = 0;
  for (int64_t m : me) {
    mmax = std::max(mmax, m);
    floor += (m + 1) / 2 * (2 * a.I * a.H / 16 + a.H * a.I / 16);
  }

  // Weights and activations (random values; one expert's weights for all experts).
  const int64_t shapes[2][2] = {{2 * a.I, a.H}, {a.H, a.I}};
  std::vector<int8_t> x(size_t(std::max<int64_t>(mmax, 1) * a.H));
  for (auto& v : x) v = int8_t(int(rng() % 255) - 127);
  std::vector<const int8_t*> rows(size_t(std::max<int64_t>(mmax, 1)));
  std::vector<float> ls(size_t(std::max<int64_t>(mmax, 1)), 0.01f);
  std::vector<float> out(size_t(std::max<int64_t>(mmax, 1) * a.H * 2 + 64));
  Gemm q8[2], q4g[2];
  std::vector<uint8_t> lhs8[2], lhs4[2];
  size_t bytes8 = 0, bytes4 = 0;
  for (int s = 0; s < 2; ++s) {
    const int64_t n = shapes[s][0], k = shapes[s][1];
    std::vector<int8_t> wv(size_t(n * k));
    std::vector<uint8_t> codes(size_t(n * k));
    for (size_t i = 0; i < wv.size(); ++i) {
      codes[i] = uint8_t(rng() % 16);
      wv[i] = int8_t(int(codes[i]) - 8);
    }
    std::vector<float> sc(size_t(n * (k / w.group)), 0.02f);
    std::vector<uint8_t> e8(sc.size(), 120);
    q8[s] = {n, k, std::vector<uint8_t>(qk->rhs_packed_size(n, k))};
    qk->pack_rhs(n, k, wv.data(), k, q8[s].rhs.data());
    q4g[s] = {n, k, std::vector<uint8_t>(q4->rhs_packed_size(n, k, w))};
    // The packer's scratch (Q4GemmUkernel::pack_scratch_bytes), 64-byte aligned.
    std::vector<uint8_t> ps(q4->pack_scratch_bytes(n, k, w) + 64);
    void* ps64 = ps.data() + (64 - reinterpret_cast<uintptr_t>(ps.data()) % 64) % 64;
    q4->pack_rhs(n, k, w, codes.data(), k,
                 w.format == cpumoe::W4Format::mxfp4 ? static_cast<const void*>(e8.data())
                                                     : static_cast<const void*>(sc.data()),
                 k / w.group, q4g[s].rhs.data(), ps64);
    bytes8 += q8[s].rhs.size();
    bytes4 += q4g[s].rhs.size();
    const int64_t m = std::max<int64_t>(mmax, 1);
    for (int64_t i = 0; i < m; ++i) rows[size_t(i)] = x.data() + (i * k) % int64_t(x.size() - k + 1);
    lhs8[s].resize(qk->lhs_packed_size(m, k));
    qk->pack_lhs(m, k, rows.data(), lhs8[s].data());
    lhs4[s].resize(q4->lhs_packed_size(m, k));
    q4->pack_lhs(m, k, rows.data(), lhs4[s].data());
  }
  std::vector<float> rs(size_t(2 * a.H + 2 * a.I), 0.02f);
  // The kernel's scratch (Q4GemmEpilogue::scratch), 64-byte aligned, at the largest call.
  size_t sbytes = 0;
  for (int s = 0; s < 2; ++s)
    sbytes = std::max(sbytes, q4->scratch_bytes(std::max<int64_t>(mmax, 1), q4g[s].n, q4g[s].k, w));
  std::vector<uint8_t> scratch_store(sbytes + 64);
  void* scratch = scratch_store.data() +
                  (64 - reinterpret_cast<uintptr_t>(scratch_store.data()) % 64) % 64;

  auto layer8 = [&] {
    for (int64_t m : me)
      if (m > 0)
        for (int s = 0; s < 2; ++s)
          qk->run_f32(m, q8[s].n, q8[s].k, lhs8[s].data(), q8[s].rhs.data(), out.data(), q8[s].n,
                      cpumoe::QGemmEpilogue{ls.data(), rs.data(), nullptr});
  };
  auto layer4 = [&] {
    for (int64_t m : me)
      if (m > 0)
        for (int s = 0; s < 2; ++s)
          q4->run_f32(m, q4g[s].n, q4g[s].k, w, lhs4[s].data(), q4g[s].rhs.data(), out.data(),
                      q4g[s].n, cpumoe::Q4GemmEpilogue{ls.data(), nullptr, false, scratch});
  };
  std::printf("problem H=%lld I=%lld E=%lld topk=%lld T=%lld iters=%lld smmla_floor_per_call=%lld\n",
              (long long)a.H, (long long)a.I, (long long)a.E, (long long)a.topk, (long long)a.T,
              (long long)a.iters, (long long)floor);
  std::printf("packed bytes per expert: %s %zu, %s %s g=%lld %zu (%.3f)\n", qk->name, bytes8,
              q4->name, a.format.c_str(), (long long)w.group, bytes4, double(bytes4) / bytes8);
  layer8();  // warm up (page faults, lazy set-up)
  layer4();
  for (int c = 0; c < 2; ++c) {
    const double t0 = now();
    getppid();  // mark: start of contender c
    for (int64_t it = 0; it < a.iters; ++it) c == 0 ? layer8() : layer4();
    getppid();  // mark: end
    std::printf("contender %d %s: %.3f ms per call\n", c, c == 0 ? qk->name : q4->name,
                1e3 * (now() - t0) / double(a.iters));
  }
  return 0;
}
