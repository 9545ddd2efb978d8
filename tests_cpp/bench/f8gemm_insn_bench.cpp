// f8gemm_insn_bench: one GEMM of each of several kernels, W8A16 FP8 (f8gemm) beside bf16 (bgemm),
// for counting instructions under qemu (qemu_plugin/qemu-insn-count) or timing natively.
//
//   cpumoe_f8gemm_insn_bench [--m 1] [--n 2048] [--k 2048] [--group 128] [--block-n 128]
//                            [--iters 2] [--kernels NAME,NAME,...]
//
// NAME is a kernel of either family (f8gemm_... or bgemm_...); by default every f8gemm and bgemm
// kernel this CPU runs, in registry order. Per kernel: packs A (m x k) and B (n x k, random
// values: the counts do not depend on them) outside the counted region, warms up with one call,
// then brackets `iters` calls of run_f32 with getppid() (a qemu-insn-count mark): marks 2c + 1,
// 2c + 2 hold contender c's region. Prints one line per contender with its wall time per call.
// Instructions per weight = (mark 2c+2 - mark 2c+1) / (iters n k).
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

#include "cpumoe/bgemm.h"
#include "cpumoe/dtype.h"
#include "cpumoe/f8gemm.h"

namespace {

struct Args {
  int64_t m = 1, n = 2048, k = 2048, group = 128, block_n = 128, iters = 2;
  std::vector<std::string> kernels;
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A 64-byte aligned view of a byte vector of at least `bytes` + 64.
void* aligned64(std::vector<uint8_t>& v, size_t bytes) {
  v.assign(bytes + 64, 0);
  return v.data() + (64 - reinterpret_cast<uintptr_t>(v.data()) % 64) % 64;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string o = argv[i], v = argv[i + 1];
    if (o == "--m") a.m = std::atoll(v.c_str());
    else if (o == "--n") a.n = std::atoll(v.c_str());
    else if (o == "--k") a.k = std::atoll(v.c_str());
    else if (o == "--group") a.group = std::atoll(v.c_str());
    else if (o == "--block-n") a.block_n = std::atoll(v.c_str());
    else if (o == "--iters") a.iters = std::atoll(v.c_str());
    else if (o == "--kernels") {
      for (size_t p = 0; p <= v.size();) {
        const size_t q = std::min(v.find(',', p), v.size());
        if (q > p) a.kernels.push_back(v.substr(p, q - p));
        p = q + 1;
      }
    } else {
      std::fprintf(stderr, "unknown option %s\n", o.c_str());
      return 2;
    }
  }
  if (a.m < 1 || a.n < 1 || a.k < 1 || a.iters < 1 ||
      (a.group < a.k && a.group % cpumoe::kF8GroupMultiple != 0) || a.block_n < 1) {
    std::fprintf(stderr, "bad shape\n");
    return 2;
  }
  if (a.kernels.empty()) {
    for (const auto* k : cpumoe::f8gemm_registry())
      if (cpumoe::cpu_supports(k->isa)) a.kernels.push_back(k->name);
    for (const auto* k : cpumoe::bgemm_registry())
      if (cpumoe::cpu_supports(k->isa)) a.kernels.push_back(k->name);
  }
  const cpumoe::F8Layout w{a.group, a.block_n};

  // Inputs: bf16 activations in [-2, 2), E4M3 codes of every non-NaN value, bf16 weights, scales.
  std::mt19937 rng(1234);
  std::vector<uint16_t> x(size_t(a.m * a.k)), wb(size_t(a.n * a.k));
  std::vector<uint8_t> codes(size_t(a.n * a.k));
  for (auto& v : x) v = cpumoe::f32_to_bf16(float(int(rng() % 512) - 256) / 128.0f);
  for (size_t i = 0; i < codes.size(); ++i) {
    uint8_t c = uint8_t(rng());
    if ((c & 0x7F) == 0x7F) c = 0x38;
    codes[i] = c;
    wb[i] = cpumoe::f32_to_bf16(cpumoe::e4m3_value(c));
  }
  const int64_t groups = cpumoe::f8_groups(a.k, w), srows = (a.n + a.block_n - 1) / a.block_n;
  std::vector<float> scales(size_t(srows * groups), 0.01f), bias(size_t(a.n), 0.5f);
  std::vector<const uint16_t*> rows(size_t(a.m));
  for (int64_t i = 0; i < a.m; ++i) rows[size_t(i)] = x.data() + i * a.k;
  std::vector<float> out(size_t(a.m * a.n));

  std::printf("problem m=%lld n=%lld k=%lld group=%lld block_n=%lld iters=%lld weights=%lld\n",
              (long long)a.m, (long long)a.n, (long long)a.k, (long long)a.group,
              (long long)a.block_n, (long long)a.iters, (long long)(a.n * a.k));
  int contender = 0;
  for (const std::string& name : a.kernels) {
    std::vector<uint8_t> lhs_store, rhs_store, scratch_store;
    const cpumoe::F8GemmUkernel* f8 = cpumoe::f8gemm_find(name.c_str());
    const cpumoe::BGemmUkernel* bg = f8 == nullptr ? cpumoe::bgemm_find(name.c_str()) : nullptr;
    if (f8 == nullptr && bg == nullptr) {
      std::fprintf(stderr, "kernel %s not compiled in\n", name.c_str());
      return 2;
    }
    if (!cpumoe::cpu_supports(f8 != nullptr ? f8->isa : bg->isa)) {
      std::fprintf(stderr, "kernel %s: this CPU lacks its ISA\n", name.c_str());
      return 2;
    }
    size_t packed_bytes = 0;
    if (f8 != nullptr) {
      void* lhs = aligned64(lhs_store, f8->lhs_packed_size(a.m, a.k));
      packed_bytes = f8->rhs_packed_size(a.n, a.k, w);
      void* rhs = aligned64(rhs_store, packed_bytes);
      void* scratch = aligned64(scratch_store, f8->scratch_bytes(a.m, a.n, a.k, w));
      f8->pack_lhs(a.m, a.k, rows.data(), lhs);
      f8->pack_rhs(a.n, a.k, w, codes.data(), a.k, scales.data(), groups, rhs);
      cpumoe::F8GemmEpilogue ep;
      ep.bias = bias.data();
      ep.scratch = scratch;
      f8->run_f32(a.m, a.n, a.k, w, lhs, rhs, out.data(), a.n, ep);  // warm up
      const double t0 = now();
      getppid();  // mark: start of this contender
      for (int64_t it = 0; it < a.iters; ++it)
        f8->run_f32(a.m, a.n, a.k, w, lhs, rhs, out.data(), a.n, ep);
      getppid();  // mark: end
      std::printf("contender %d %s: %.3f ms per call, packed B %zu bytes\n", contender, name.c_str(),
                  1e3 * (now() - t0) / double(a.iters), packed_bytes);
    } else {
      void* lhs = aligned64(lhs_store, bg->lhs_packed_size(a.m, a.k));
      packed_bytes = bg->rhs_packed_size(a.n, a.k);
      void* rhs = aligned64(rhs_store, packed_bytes);
      bg->pack_lhs(a.m, a.k, rows.data(), lhs);
      bg->pack_rhs(a.n, a.k, wb.data(), a.k, rhs);
      bg->run_f32(a.m, a.n, a.k, lhs, rhs, out.data(), a.n, bias.data());  // warm up
      const double t0 = now();
      getppid();  // mark: start of this contender
      for (int64_t it = 0; it < a.iters; ++it)
        bg->run_f32(a.m, a.n, a.k, lhs, rhs, out.data(), a.n, bias.data());
      getppid();  // mark: end
      std::printf("contender %d %s: %.3f ms per call, packed B %zu bytes\n", contender, name.c_str(),
                  1e3 * (now() - t0) / double(a.iters), packed_bytes);
    }
    ++contender;
  }
  return 0;
}
