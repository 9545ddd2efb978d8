// The MoE dispatcher: routing, quantization, packing and the GEMM1 -> activation -> requantize ->
// GEMM2 -> combine pipeline, over whatever QGemmUkernel the weights were packed for.
//
// Phases of one call (each parallel over independent tasks; every output element is computed by
// exactly one task in a fixed order, so results do not depend on the thread count):
//   1. quantize each token once                        xq [T, H] int8, xs [T]
//   2. route: stable counting sort of the T*k slots by expert
//   3. gather + pack each active expert's token rows for the kernel
//   4. GEMM1 tasks (expert, row chunk, column tile)     h [P, 2I] fp32 (P = T*k, in expert order)
//   5. activation, round to the input dtype, requantize qa [P, I] int8, sa [P]; pack again
//   6. GEMM2 tasks                                      y [P, H] fp32
//   7. combine per token: out[t] = sum_j w[t,j] * y[slot(t,j)] in fp32, stored in the input dtype
// Experts with no tokens appear in no task. Tokens are processed in chunks so scratch memory stays
// bounded for any batch.
#include "cpumoe/moe.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace cpumoe {
namespace {

constexpr size_t kAlign = 64;
// Slots (token x expert pairs) per chunk: bounds scratch to a few tens of MB at typical shapes.
constexpr int64_t kSlotsPerChunk = 16384;
// Row chunk of a GEMM task: large enough that weights are streamed once per call for any
// realistic number of tokens per expert, small enough to split a huge expert across threads.
constexpr int64_t kRowsPerTask = 256;

int resolve_threads(int n) {
#if defined(_OPENMP)
  return n > 0 ? n : omp_get_max_threads();
#else
  (void)n;
  return 1;
#endif
}

// Runs fn(i, tid) for i in [0, n) on up to `threads` threads, dynamically scheduled; tid in
// [0, threads) indexes per-thread scratch. It is this loop's own index, never a caller's (a
// caller may itself be inside an OpenMP region).
template <class Fn>
void parallel_for(int64_t n, int threads, const Fn& fn) {
#if defined(_OPENMP)
  if (threads > 1 && n > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) fn(i, omp_get_thread_num());
    return;
  }
#endif
  (void)threads;
  for (int64_t i = 0; i < n; ++i) fn(i, 0);
}

struct AlignedBuffer {
  void* p = nullptr;
  explicit AlignedBuffer(size_t bytes) {
    p = std::aligned_alloc(kAlign, std::max(kAlign, size_t(round_up(int64_t(bytes), kAlign))));
    if (p == nullptr) throw std::bad_alloc();
  }
  ~AlignedBuffer() { std::free(p); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

[[noreturn]] void fail(const std::string& msg) { throw ArgumentError(msg); }

void check_scales(const float* s, int64_t n, const char* name) {
  if (s == nullptr) fail(std::string(name) + ": missing");
  for (int64_t i = 0; i < n; ++i) {
    if (!(s[i] > 0.0f) || !std::isfinite(s[i]))
      fail(std::string(name) + ": every scale must be finite and > 0 (element " +
           std::to_string(i) + " is " + std::to_string(s[i]) + ")");
  }
}

std::unique_ptr<float[]> to_f32(const void* p, DType dt, int64_t n) {
  std::unique_ptr<float[]> out(new float[size_t(n)]);
  for (int64_t i = 0; i < n; ++i) out[i] = load_as_f32(p, dt, i);
  return out;
}

// Column tile of a GEMM: a multiple of nr, at most 256 columns (the weight tile then stays in L2
// for any K we meet), and small enough that there are about 4 tasks per thread.
int64_t choose_n_tile(int64_t n, int64_t nr, int64_t row_tasks, int threads) {
  const int64_t want_tasks = 4 * int64_t(threads);
  int64_t tiles = std::max<int64_t>(1, (want_tasks + row_tasks - 1) / row_tasks);
  tiles = std::max(tiles, (n + 255) / 256);
  const int64_t tile = round_up((n + tiles - 1) / tiles, nr);
  return std::max(nr, tile);
}

struct Task {
  int64_t e, m0, m, n0, n;
};

// Tasks over (expert, row chunk, column tile) for a GEMM with n output columns.
std::vector<Task> make_tasks(const std::vector<int64_t>& active, const std::vector<int64_t>& count,
                             int64_t n, int64_t mr, int64_t nr, int threads) {
  const int64_t rows_per_task = round_up(kRowsPerTask, mr);
  int64_t row_tasks = 0;
  for (int64_t e : active) row_tasks += (count[e] + rows_per_task - 1) / rows_per_task;
  const int64_t tile = choose_n_tile(n, nr, row_tasks, threads);
  std::vector<Task> tasks;
  tasks.reserve(size_t(row_tasks * ((n + tile - 1) / tile)));
  for (int64_t e : active)
    for (int64_t m0 = 0; m0 < count[e]; m0 += rows_per_task)
      for (int64_t n0 = 0; n0 < n; n0 += tile)
        tasks.push_back({e, m0, std::min(rows_per_task, count[e] - m0), n0, std::min(tile, n - n0)});
  return tasks;
}

template <class T>
inline float quantize_typed(const T* x, int64_t n, int8_t* q, float (*load)(T)) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(load(x[i]));
    amax = a > amax ? a : amax;  // NaN never wins the max
  }
  const float s = std::max(amax, kAmaxFloor) / 127.0f;
  for (int64_t i = 0; i < n; ++i) {
    float v = load(x[i]) / s;
    v = (v + 12582912.0f) - 12582912.0f;  // round half to even (|v| <= 127 here)
    v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
    q[i] = v == v ? int8_t(v) : int8_t(0);  // NaN quantizes to 0 instead of undefined behaviour
  }
  return s;
}

inline float load_f32(float v) { return v; }

// The id as given (global when an expert map is set).
inline int64_t load_raw_id(const MoeCall& c, int64_t t, int64_t j) {
  if (c.topk_ids_int64)
    return static_cast<const int64_t*>(c.topk_ids)[t * c.topk_ids_row_stride + j];
  return static_cast<const int32_t*>(c.topk_ids)[t * c.topk_ids_row_stride + j];
}

// The local expert of slot (t, j), or -1 when the expert map says it is elsewhere. Ids were
// validated first.
inline int64_t load_id(const MoeCall& c, int64_t t, int64_t j) {
  const int64_t e = load_raw_id(c, t, j);
  return c.expert_map != nullptr ? c.expert_map[e] : e;
}

void validate(const PackedMoe& pk, const MoeCall& c) {
  const int64_t H = pk.hidden();
  if (c.num_tokens < 0) fail("x: number of tokens must be >= 0");
  if (c.topk < 1) fail("topk_ids: k (columns of topk_ids) must be >= 1, got " + std::to_string(c.topk));
  if (c.skip_weighted && c.topk != 1)
    fail("skip_weighted: only allowed with k == 1 (got k = " + std::to_string(c.topk) + ")");
  if (c.num_tokens == 0) return;
  if (c.x == nullptr) fail("x: null data pointer");
  if (c.out == nullptr) fail("out: null data pointer");
  if (c.topk_ids == nullptr) fail("topk_ids: null data pointer");
  if (c.topk_weights == nullptr && !c.skip_weighted) fail("topk_weights: null data pointer");
  if (c.x_row_stride < H) fail("x: row stride must be >= H");
  if (c.out_row_stride < H) fail("out: row stride must be >= H");
  if (c.topk_ids_row_stride < c.topk) fail("topk_ids: row stride must be >= k");
  if (c.topk_weights != nullptr && c.topk_weights_row_stride < c.topk)
    fail("topk_weights: row stride must be >= k");
  const int64_t es = dtype_size(c.dtype);
  const auto* xb = static_cast<const uint8_t*>(c.x);
  const auto* ob = static_cast<const uint8_t*>(c.out);
  const int64_t span_x = ((c.num_tokens - 1) * c.x_row_stride + H) * es;
  const int64_t span_o = ((c.num_tokens - 1) * c.out_row_stride + H) * es;
  if (ob < xb + span_x && xb < ob + span_o) fail("out: must not overlap x");
  const int64_t E = pk.num_experts();
  const int64_t ids_bound = c.expert_map != nullptr ? c.num_global_experts : E;
  if (c.expert_map != nullptr) {
    if (c.num_global_experts < 1) fail("expert_map: num_global_experts must be >= 1");
    for (int64_t g = 0; g < c.num_global_experts; ++g) {
      if (c.expert_map[g] < -1 || c.expert_map[g] >= E)
        fail("expert_map: entry " + std::to_string(g) + " is " + std::to_string(c.expert_map[g]) +
             ", outside [-1, " + std::to_string(E) + ")");
    }
  }
  for (int64_t t = 0; t < c.num_tokens; ++t) {
    for (int64_t j = 0; j < c.topk; ++j) {
      const int64_t e = load_raw_id(c, t, j);
      if (e < 0 || e >= ids_bound)
        fail("topk_ids: expert id " + std::to_string(e) + " at [" + std::to_string(t) + ", " +
             std::to_string(j) + "] is outside [0, " + std::to_string(ids_bound) + ")");
    }
  }
}

void store_row(const float* acc, int64_t n, DType dt, void* dst) {
  switch (dt) {
    case DType::f32: std::memcpy(dst, acc, size_t(n) * 4); break;
    case DType::f16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(acc[i]);
      break;
    }
    case DType::bf16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(acc[i]);
      break;
    }
  }
}

// Scratch of one chunk of tokens, sized once per chunk.
struct Chunk {
  const PackedMoe& pk;
  const MoeCall& c;
  const QGemmUkernel& kern;
  int threads;
  int64_t t0, tc;
  int64_t P = 0;  // slots routed to a local expert (all of them without an expert map)
  int64_t E, H, I;
  std::vector<int64_t> count, first;  // per expert: slots and first sorted position
  std::vector<int64_t> active;        // experts with count > 0, ascending
  std::vector<int64_t> pos_of;        // slot (t*k + j, local t) -> sorted position, or -1
  std::vector<int64_t> token_of;      // sorted position -> local token

  Chunk(const PackedMoe& p, const MoeCall& call, int th, int64_t t_begin, int64_t t_count)
      : pk(p), c(call), kern(p.kernel()), threads(th), t0(t_begin), tc(t_count),
        E(p.num_experts()), H(p.hidden()), I(p.intermediate()) {}

  void route() {
    const int64_t k = c.topk;
    count.assign(size_t(E), 0);
    for (int64_t t = 0; t < tc; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = load_id(c, t0 + t, j);
        if (e >= 0) ++count[size_t(e)];
      }
    }
    first.assign(size_t(E), 0);
    int64_t acc = 0;
    for (int64_t e = 0; e < E; ++e) {
      first[e] = acc;
      acc += count[e];
      if (count[e] > 0) active.push_back(e);
    }
    P = acc;  // slots routed to a local expert
    pos_of.resize(size_t(tc * k));
    token_of.resize(size_t(P));
    std::vector<int64_t> fill(first);
    for (int64_t t = 0; t < tc; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = load_id(c, t0 + t, j);
        if (e < 0) {
          pos_of[t * k + j] = -1;
          continue;
        }
        const int64_t pos = fill[size_t(e)]++;
        pos_of[t * k + j] = pos;
        token_of[pos] = t;
      }
    }
  }

  // Byte offsets of each active expert's packed rows for depth `depth`.
  std::vector<size_t> lhs_offsets(int64_t depth, size_t* total) const {
    std::vector<size_t> off(size_t(E), 0);
    size_t acc = 0;
    for (int64_t e : active) {
      off[e] = acc;
      acc += size_t(round_up(int64_t(kern.lhs_packed_size(count[e], depth)), kAlign));
    }
    *total = acc;
    return off;
  }

  // Packs, per active expert, the rows rows[first[e] .. first[e] + count[e]).
  void pack_rows(const std::vector<const int8_t*>& rows, int64_t depth,
                 const std::vector<size_t>& off, uint8_t* dst) const {
    parallel_for(int64_t(active.size()), threads, [&](int64_t i, int) {
      const int64_t e = active[size_t(i)];
      kern.pack_lhs(count[e], depth, rows.data() + first[e], dst + off[e]);
    });
  }

  template <class WeightsOf, class ScaleOf, class BiasOf>
  void gemm(int64_t n, int64_t depth, const uint8_t* lhs, const std::vector<size_t>& off,
            const float* row_scale, float* dst, const WeightsOf& weights, const ScaleOf& scale,
            const BiasOf& bias) const {
    const std::vector<Task> tasks = make_tasks(active, count, n, kern.mr, kern.nr, threads);
    parallel_for(int64_t(tasks.size()), threads, [&](int64_t i, int) {
      const Task& tk = tasks[size_t(i)];
      const int64_t row0 = first[tk.e] + tk.m0;
      const float* b = bias(tk.e);
      const QGemmEpilogue ep{row_scale + row0, scale(tk.e) + tk.n0, b ? b + tk.n0 : nullptr};
      kern.run_f32(tk.m, tk.n, depth, lhs + off[tk.e] + kern.lhs_packed_offset(tk.m0, depth),
                   static_cast<const uint8_t*>(weights(tk.e)) + kern.rhs_packed_offset(tk.n0, depth),
                   dst + row0 * n + tk.n0, n, ep);
    });
  }

  void run() {
    route();
    const int64_t k = c.topk;
    const int64_t xes = dtype_size(c.dtype);

    // 1. Quantize each token once.
    std::vector<int8_t> xq(static_cast<size_t>(tc * H));
    std::vector<float> xs(static_cast<size_t>(tc));
    parallel_for(tc, threads, [&](int64_t t, int) {
      const auto* row = static_cast<const uint8_t*>(c.x) + (t0 + t) * c.x_row_stride * xes;
      xs[t] = quantize_row(row, c.dtype, H, xq.data() + t * H);
    });

    // 3. Gather each expert's token rows and pack them.
    std::vector<const int8_t*> rows(static_cast<size_t>(P));
    std::vector<float> row_scale(static_cast<size_t>(P));
    for (int64_t p = 0; p < P; ++p) {
      rows[p] = xq.data() + token_of[p] * H;
      row_scale[p] = xs[token_of[p]];
    }
    size_t lhs1_bytes = 0;
    const std::vector<size_t> off1 = lhs_offsets(H, &lhs1_bytes);
    AlignedBuffer lhs1(lhs1_bytes);
    pack_rows(rows, H, off1, lhs1.as<uint8_t>());

    // 4. GEMM1.
    std::vector<float> h(static_cast<size_t>(P * 2 * I));
    gemm(2 * I, H, lhs1.as<uint8_t>(), off1, row_scale.data(), h.data(),
         [&](int64_t e) { return pk.w13(e); }, [&](int64_t e) { return pk.s13(e); },
         [&](int64_t e) { return pk.b13(e); });

    // 5. Activation, rounding to the input dtype, requantization.
    std::vector<int8_t> qa(static_cast<size_t>(P * I));
    std::vector<float> sa(static_cast<size_t>(P));
    std::vector<float> tmp(static_cast<size_t>(threads) * size_t(I));
    parallel_for(P, threads, [&](int64_t p, int tid) {
      float* a = tmp.data() + size_t(tid) * size_t(I);
      vec::gated_row(c.activation, h.data() + p * 2 * I, I, a);
      if (c.dtype != DType::f32)
        for (int64_t i = 0; i < I; ++i) a[i] = round_to_dtype(a[i], c.dtype);
      sa[p] = quantize_row(a, DType::f32, I, qa.data() + p * I);
    });
    for (int64_t p = 0; p < P; ++p) rows[p] = qa.data() + p * I;
    size_t lhs2_bytes = 0;
    const std::vector<size_t> off2 = lhs_offsets(I, &lhs2_bytes);
    AlignedBuffer lhs2(lhs2_bytes);
    pack_rows(rows, I, off2, lhs2.as<uint8_t>());

    // 6. GEMM2.
    std::vector<float> y(static_cast<size_t>(P * H));
    gemm(H, I, lhs2.as<uint8_t>(), off2, sa.data(), y.data(),
         [&](int64_t e) { return pk.w2(e); }, [&](int64_t e) { return pk.s2(e); },
         [&](int64_t e) { return pk.b2(e); });

    // 7. Weighted combine, fp32, slots in their given order.
    std::vector<float> accs(static_cast<size_t>(threads) * size_t(H));
    parallel_for(tc, threads, [&](int64_t t, int tid) {
      float* acc = accs.data() + size_t(tid) * size_t(H);
      std::fill(acc, acc + H, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        if (pos_of[t * k + j] < 0) continue;  // expert not on this rank
        const float w = c.skip_weighted ? 1.0f : c.topk_weights[(t0 + t) * c.topk_weights_row_stride + j];
        const float* yr = y.data() + pos_of[t * k + j] * H;
        for (int64_t i = 0; i < H; ++i) acc[i] += w * yr[i];
      }
      store_row(acc, H, c.dtype, static_cast<uint8_t*>(c.out) + (t0 + t) * c.out_row_stride * xes);
    });
  }
};

}  // namespace

float quantize_row(const void* x, DType dt, int64_t n, int8_t* q) {
  switch (dt) {
    case DType::f32: return quantize_typed(static_cast<const float*>(x), n, q, load_f32);
    case DType::f16: return quantize_typed(static_cast<const uint16_t*>(x), n, q, f16_to_f32);
    case DType::bf16: return quantize_typed(static_cast<const uint16_t*>(x), n, q, bf16_to_f32);
  }
  return 1.0f;
}

void PackedMoe::AlignedFree::operator()(void* p) const { std::free(p); }

PackedMoe::PackedMoe(const MoeWeights& w, const QGemmUkernel* kernel, int num_threads)
    : e_(w.num_experts), h_(w.hidden), i_(w.intermediate),
      kernel_(kernel ? kernel : qgemm_select()) {
  if (e_ < 1) fail("w13: number of experts must be >= 1");
  if (h_ < kDimMultiple || h_ % kDimMultiple != 0)
    fail("w13: hidden size H = " + std::to_string(h_) + " must be a positive multiple of " +
         std::to_string(kDimMultiple));
  if (i_ < kDimMultiple || i_ % kDimMultiple != 0)
    fail("w2: intermediate size I = " + std::to_string(i_) + " must be a positive multiple of " +
         std::to_string(kDimMultiple));
  if (w.w13 == nullptr) fail("w13: missing");
  if (w.w2 == nullptr) fail("w2: missing");
  check_scales(w.s13, e_ * 2 * i_, "s13");
  check_scales(w.s2, e_ * h_, "s2");
  if (!cpu_supports(kernel_->isa))
    fail(std::string("isa: kernel ") + kernel_->name + " needs " + isa_name(kernel_->isa) +
         ", which this CPU lacks");

  const int threads = resolve_threads(num_threads);
  const QGemmUkernel& k = *kernel_;
  w13_stride_ = size_t(round_up(int64_t(k.rhs_packed_size(2 * i_, h_)), int64_t(kAlign)));
  w2_stride_ = size_t(round_up(int64_t(k.rhs_packed_size(h_, i_)), int64_t(kAlign)));
  w13_.reset(static_cast<uint8_t*>(std::aligned_alloc(kAlign, w13_stride_ * size_t(e_))));
  w2_.reset(static_cast<uint8_t*>(std::aligned_alloc(kAlign, w2_stride_ * size_t(e_))));
  if (!w13_ || !w2_) throw std::bad_alloc();
  parallel_for(e_, threads, [&](int64_t e, int) {
    k.pack_rhs(2 * i_, h_, w.w13 + e * 2 * i_ * h_, h_, w13_.get() + size_t(e) * w13_stride_);
    k.pack_rhs(h_, i_, w.w2 + e * h_ * i_, i_, w2_.get() + size_t(e) * w2_stride_);
  });
  s13_.reset(new float[size_t(e_ * 2 * i_)]);
  s2_.reset(new float[size_t(e_ * h_)]);
  std::memcpy(s13_.get(), w.s13, size_t(e_ * 2 * i_) * 4);
  std::memcpy(s2_.get(), w.s2, size_t(e_ * h_) * 4);
  if (w.b13 != nullptr) {
    b13_ = to_f32(w.b13, w.b13_dtype, e_ * 2 * i_);
    has_b13_ = true;
  }
  if (w.b2 != nullptr) {
    b2_ = to_f32(w.b2, w.b2_dtype, e_ * h_);
    has_b2_ = true;
  }
}

PackedMoe::~PackedMoe() = default;

size_t PackedMoe::packed_bytes() const {
  size_t n = (w13_stride_ + w2_stride_) * size_t(e_) + size_t(e_ * (2 * i_ + h_)) * 4;
  if (has_b13_) n += size_t(e_ * 2 * i_) * 4;
  if (has_b2_) n += size_t(e_ * h_) * 4;
  return n;
}

const void* PackedMoe::w13(int64_t e) const { return w13_.get() + size_t(e) * w13_stride_; }
const void* PackedMoe::w2(int64_t e) const { return w2_.get() + size_t(e) * w2_stride_; }

void fused_moe_int8(const PackedMoe& packed, const MoeCall& call) {
  validate(packed, call);
  if (call.num_tokens == 0) return;
  const int threads = resolve_threads(call.num_threads);
  const int64_t tokens_per_chunk = std::max<int64_t>(1, kSlotsPerChunk / call.topk);
  for (int64_t t0 = 0; t0 < call.num_tokens; t0 += tokens_per_chunk) {
    Chunk chunk(packed, call, threads, t0, std::min(tokens_per_chunk, call.num_tokens - t0));
    chunk.run();
  }
}

}  // namespace cpumoe
