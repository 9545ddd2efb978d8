// cpumoe_q4gemm_bench: the W4A8 (q4gemm) kernels' weight-read bandwidth with cold weights, beside
// a plain read of the same bytes and the W8A8 (qgemm) kernel on the same problem.
//
// Problem: one call is one expert's GEMM, m rows x n columns x depth k (default the Qwen3-30B-A3B
// GEMM1: n = 2I = 1536, k = H = 2048). The packed weights of many experts fill a buffer far larger
// than the L3 (--mib, per contender), and each thread walks its own experts through it in turn, so
// every call reads its weights from memory, as decode does. Reported per contender: time per call
// (median and min over --reps repeats of --calls calls per thread), the weight bytes a call reads
// (4-bit codes + scales for q4gemm, int8 + column data for qgemm), the achieved GB/s over all
// threads, and the ratio to the read probe (a plain 64-bit sum over the same expert ranges with
// the kernels' software prefetch distance, 1 KiB, in the same run, alternating with the kernels).
//
//   cpumoe_q4gemm_bench [--threads 2] [--m 1,16] [--n 1536] [--k 2048] [--mib 512] [--reps 7]
//                       [--calls 200] [--kernel NAME] [--formats int4:128,int4:32,mxfp4]
//
// --formats: the W4A8 weight formats, int4:G (group G, a multiple of 32 dividing k) or mxfp4.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cpumoe/q4gemm.h"
#include "cpumoe/qgemm.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  int threads = 2;
  std::vector<int64_t> ms{1, 16};
  int64_t n = 1536, k = 2048, mib = 512, calls = 200;
  int reps = 7;
  std::string kernel;
  std::string formats = "int4:128,int4:32,mxfp4";
};

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> v;
  for (const char* p = s; *p;) {
    v.push_back(std::strtoll(p, nullptr, 10));
    const char* c = std::strchr(p, ',');
    if (c == nullptr) break;
    p = c + 1;
  }
  return v;
}

// A buffer of `experts` packed matrices of `stride` bytes each (64-byte aligned), filled so that
// its pages are real.
struct ExpertBuffer {
  std::vector<uint8_t> store;
  uint8_t* base = nullptr;
  size_t stride = 0;
  int64_t experts = 0;
  ExpertBuffer(size_t bytes_per_expert, int64_t mib, const void* one) {
    stride = (bytes_per_expert + 4095) / 4096 * 4096;
    experts = std::max<int64_t>(2, int64_t((size_t(mib) << 20) / stride));
    store.resize(stride * size_t(experts) + 64);
    base = store.data() + (64 - reinterpret_cast<uintptr_t>(store.data()) % 64) % 64;
    for (int64_t e = 0; e < experts; ++e) std::memcpy(expert(e), one, bytes_per_expert);
  }
  uint8_t* expert(int64_t e) const { return base + size_t(e) * stride; }
};

// Runs body(thread, expert) for `calls` experts per thread (thread t takes experts t, t + T, ...
// in a ring over the buffer, continuing where the last repeat stopped); returns seconds.
template <class Body>
double timed(int threads, int64_t calls, int64_t experts, int64_t* cursor, const Body& body) {
  std::vector<std::thread> pool;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  const int64_t start = *cursor;
  Clock::time_point t0;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) {
      }
      for (int64_t c = 0; c < calls; ++c) body(t, (start + c * threads + t) % experts);
    });
  }
  while (ready.load() < threads) {
  }
  t0 = Clock::now();
  go.store(true, std::memory_order_release);
  for (auto& th : pool) th.join();
  *cursor = (start + calls * threads) % experts;
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Contender {
  std::string name;
  size_t bytes = 0;  // weight bytes one call reads
  std::vector<double> secs;
};

void report(const Contender& c, int64_t calls, int threads, double probe_gbs) {
  std::vector<double> s = c.secs;
  std::sort(s.begin(), s.end());
  const double med = s[s.size() / 2], mn = s.front();
  const double per_call_us = med / double(calls) * 1e6;
  const double gbs = double(c.bytes) * double(calls) * threads / med / 1e9;
  std::printf("  %-44s %9.1f us/call (min %7.1f)  %8.3f MB/call  %6.2f GB/s  %5.1f%% of read\n",
              c.name.c_str(), per_call_us, mn / double(calls) * 1e6, double(c.bytes) / 1e6, gbs,
              probe_gbs > 0 ? 100.0 * gbs / probe_gbs : 0.0);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i];
    const char* v = argv[i + 1];
    if (f == "--threads") a.threads = std::atoi(v);
    else if (f == "--m") a.ms = parse_list(v);
    else if (f == "--n") a.n = std::atoll(v);
    else if (f == "--k") a.k = std::atoll(v);
    else if (f == "--mib") a.mib = std::atoll(v);
    else if (f == "--reps") a.reps = std::atoi(v);
    else if (f == "--calls") a.calls = std::atoll(v);
    else if (f == "--kernel") a.kernel = v;
    else if (f == "--formats") a.formats = v;
    else { std::fprintf(stderr, "unknown flag %s\n", f.c_str()); return 2; }
  }
  const cpumoe::Q4GemmUkernel* q4 =
      a.kernel.empty() ? cpumoe::q4gemm_select() : cpumoe::q4gemm_find(a.kernel.c_str());
  if (q4 == nullptr) { std::fprintf(stderr, "no kernel %s\n", a.kernel.c_str()); return 2; }
  const cpumoe::QGemmUkernel* q8 = cpumoe::qgemm_select();
  const int64_t n = a.n, k = a.k, max_m = *std::max_element(a.ms.begin(), a.ms.end());
  std::printf("q4gemm %s vs qgemm %s: n=%lld k=%lld, %d threads, %lld MiB per buffer\n", q4->name,
              q8->name, (long long)n, (long long)k, a.threads, (long long)a.mib);

  std::mt19937 rng(1);
  std::vector<int8_t> act(size_t(max_m * k)), w8(size_t(n * k));
  std::vector<uint8_t> codes(size_t(n * k));
  for (auto& v : act) v = int8_t(int(rng() % 255) - 127);
  for (auto& v : w8) v = int8_t(int(rng() % 255) - 127);
  for (auto& v : codes) v = uint8_t(rng() & 15);
  std::vector<const int8_t*> rows(static_cast<size_t>(max_m));
  for (int64_t i = 0; i < max_m; ++i) rows[size_t(i)] = act.data() + i * k;
  std::vector<float> lscale(size_t(max_m), 0.01f), rscale(size_t(n), 0.02f);

  // The W8A8 contender, packed once and copied into its cold buffer.
  std::vector<uint8_t> one8(q8->rhs_packed_size(n, k));
  q8->pack_rhs(n, k, w8.data(), k, one8.data());
  const ExpertBuffer buf8(one8.size(), a.mib, one8.data());
  std::vector<uint8_t> lhs8(q8->lhs_packed_size(max_m, k) + 64);
  q8->pack_lhs(max_m, k, rows.data(), lhs8.data());

  struct Fmt { cpumoe::W4Layout w; std::string label; };
  std::vector<Fmt> fmts;
  for (size_t p = 0; p <= a.formats.size();) {
    const size_t e = std::min(a.formats.find(',', p), a.formats.size());
    const std::string f = a.formats.substr(p, e - p);
    p = e + 1;
    if (f == "mxfp4") {
      fmts.push_back({{cpumoe::W4Format::mxfp4, 32}, "mxfp4"});
    } else if (f.rfind("int4:", 0) == 0) {
      const int64_t g = std::atoll(f.c_str() + 5);
      if (g <= 0 || g % 32 != 0 || k % g != 0) {
        std::fprintf(stderr, "--formats: group %lld is not a multiple of 32 dividing k\n", (long long)g);
        return 2;
      }
      fmts.push_back({{cpumoe::W4Format::int4, g}, "int4 g=" + std::to_string(g)});
    } else {
      std::fprintf(stderr, "--formats: unknown format '%s' (int4:G or mxfp4)\n", f.c_str());
      return 2;
    }
  }
  std::vector<uint8_t> lhs4(q4->lhs_packed_size(max_m, k) + 64);
  q4->pack_lhs(max_m, k, rows.data(), lhs4.data());
  std::vector<std::vector<float>> out(size_t(a.threads), std::vector<float>(size_t(max_m * n)));

  for (const Fmt& fm : fmts) {
    const int64_t groups = k / fm.w.group;
    std::vector<uint8_t> sc(size_t(n * groups * fm.w.scale_bytes()));
    for (int64_t j = 0; j < n * groups; ++j) {
      if (fm.w.format == cpumoe::W4Format::mxfp4) sc[size_t(j)] = uint8_t(120 + rng() % 8);
      else { const float v = 0.001f * float(1 + rng() % 100); std::memcpy(&sc[size_t(4 * j)], &v, 4); }
    }
    std::vector<uint8_t> one4(q4->rhs_packed_size(n, k, fm.w));
    // The packer's scratch (Q4GemmUkernel::pack_scratch_bytes), 64-byte aligned.
    std::vector<uint8_t> ps(q4->pack_scratch_bytes(n, k, fm.w) + 64);
    void* ps64 = ps.data() + (64 - reinterpret_cast<uintptr_t>(ps.data()) % 64) % 64;
    q4->pack_rhs(n, k, fm.w, codes.data(), k, sc.data(), groups, one4.data(), ps64);
    const ExpertBuffer buf4(one4.size(), a.mib, one4.data());
    std::printf("%s: %lld experts of %.3f MB (int8: %lld of %.3f MB)\n", fm.label.c_str(),
                (long long)buf4.experts, double(one4.size()) / 1e6, (long long)buf8.experts,
                double(one8.size()) / 1e6);
    // Each thread's kernel scratch (Q4GemmEpilogue::scratch): 64-byte aligned, at the largest m.
    const size_t sbytes = q4->scratch_bytes(max_m, n, k, fm.w);
    std::vector<std::vector<uint8_t>> scratch(size_t(a.threads), std::vector<uint8_t>(sbytes + 64));
    auto scratch_of = [&](int t) {
      const auto at = reinterpret_cast<uintptr_t>(scratch[size_t(t)].data());
      return static_cast<void*>(scratch[size_t(t)].data() + (64 - at % 64) % 64);
    };
    for (int64_t m : a.ms) {
      Contender probe{"read probe (same bytes as " + fm.label + ")", one4.size(), {}};
      Contender c4{std::string(q4->name) + " " + fm.label, one4.size(), {}};
      Contender c8{std::string(q8->name), one8.size(), {}};
      int64_t cur_p = 0, cur_4 = 0, cur_8 = 0;
      std::vector<uint64_t> sink(size_t(a.threads));
      const size_t words = one4.size() / 8;
      for (int rep = 0; rep < a.reps; ++rep) {  // the contenders alternate within each repeat
        probe.secs.push_back(timed(a.threads, a.calls, buf4.experts, &cur_p, [&](int t, int64_t e) {
          const auto* p = reinterpret_cast<const uint64_t*>(buf4.expert(e));
          uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
          for (size_t x = 0; x + 8 <= words; x += 8) {  // a line per step, prefetched as the kernels do
            __builtin_prefetch(p + x + 128, 0, 3);
            s0 += p[x] + p[x + 4], s1 += p[x + 1] + p[x + 5], s2 += p[x + 2] + p[x + 6];
            s3 += p[x + 3] + p[x + 7];
          }
          sink[size_t(t)] += s0 + s1 + s2 + s3;
        }));
        c4.secs.push_back(timed(a.threads, a.calls, buf4.experts, &cur_4, [&](int t, int64_t e) {
          const cpumoe::Q4GemmEpilogue ep{lscale.data(), nullptr, false, scratch_of(t)};
          q4->run_f32(m, n, k, fm.w, lhs4.data(), buf4.expert(e), out[size_t(t)].data(), n, ep);
        }));
        c8.secs.push_back(timed(a.threads, a.calls, buf8.experts, &cur_8, [&](int t, int64_t e) {
          const cpumoe::QGemmEpilogue ep{lscale.data(), rscale.data(), nullptr};
          q8->run_f32(m, n, k, lhs8.data(), buf8.expert(e), out[size_t(t)].data(), n, ep);
        }));
      }
      std::vector<double> ps = probe.secs;
      std::sort(ps.begin(), ps.end());
      const double probe_gbs = double(probe.bytes) * double(a.calls) * a.threads / ps[ps.size() / 2] / 1e9;
      std::printf(" m=%lld\n", (long long)m);
      report(probe, a.calls, a.threads, probe_gbs);
      report(c4, a.calls, a.threads, probe_gbs);
      report(c8, a.calls, a.threads, probe_gbs);
      std::vector<double> s4 = c4.secs, s8 = c8.secs;
      std::sort(s4.begin(), s4.end());
      std::sort(s8.begin(), s8.end());
      std::printf("  time W4A8 / W8A8 = %.3f (medians)%s\n", s4[s4.size() / 2] / s8[s8.size() / 2],
                  sink[0] == 42 ? " " : "");
    }
  }
  return 0;
}
