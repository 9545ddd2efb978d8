// The MoE dispatcher: routing, quantization, packing and the GEMM1 -> activation -> requantize ->
// GEMM2 -> combine pipeline, over whatever kernel the weights were packed for: a QGemmUkernel
// (the W8A8 op) or a BGemmUkernel (the BF16 op). One pipeline serves both; the two differ only in
// how a GEMM input row is made (int8 + scale, or bf16) and in the GEMM epilogue.
//
// Phases of one call (each parallel over independent tasks; every output element is computed by
// exactly one task in a fixed order, so results do not depend on the thread count):
//   1. quantize each token once                        xq [T, H] int8, xs [T]  (bf16: xq bf16)
//   2. route: stable counting sort of the T*k slots by expert
//   3. gather + pack each active expert's token rows for the kernel
//   4. GEMM1 tasks (expert, row chunk, column tile)     h [P, 2I] fp32 (P = T*k, in expert order)
//   5. activation, round to the input dtype, requantize qa [P, I] int8, sa [P]  (bf16: round to
//      bf16, qa bf16); pack again
//   6. GEMM2 tasks                                      y [P, H] fp32
//   7. combine per token: out[t] = sum_j w[t,j] * y[slot(t,j)] in fp32, stored in the input dtype
// Experts with no tokens appear in no task. Tokens are processed in chunks of at most
// kSlotsPerChunk slots, so scratch memory is bounded for any batch.
//
// Scratch: every buffer of a chunk is carved from one 64-byte aligned block owned by the *calling*
// thread (thread_local), which grows to the largest chunk seen and is reused by later calls (no
// allocation, no page faults in steady state). Concurrent callers each have their own block; the
// OpenMP workers of a call only write into their caller's block. The layout of a chunk is computed
// by one function, plan(), which the public fused_moe_scratch_bytes() evaluates at the worst-case
// routing, so the reported bound and the real use cannot drift apart.
//
// Sizes and offsets are int64_t / size_t throughout (T * k * H exceeds 2^31 at real shapes).
#include "cpumoe/moe.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "cpumoe/bench_hooks.h"  // no-ops unless built with CPUMOE_BENCH_HOOKS
#include "../ukernels/rowops/quantize.h"  // internal: the scalar row operations
#include "cpumoe/rowops.h"

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
// A thread count above this (and above both the processor count and OMP_NUM_THREADS) is capped:
// results do not depend on it, and asking libgomp for a million threads would abort the process.
constexpr int kMaxThreads = 256;

int resolve_threads(int n) {
#if defined(_OPENMP)
  if (n <= 0) return std::max(1, omp_get_max_threads());
  return std::min(n, std::max({kMaxThreads, omp_get_num_procs(), omp_get_max_threads()}));
#else
  (void)n;
  return 1;
#endif
}

// Below this much work (in elements touched) a row phase runs on the calling thread: waking the
// team costs more (with OMP_WAIT_POLICY=PASSIVE, tens of microseconds) than, at decode, packing
// or activating the few rows of 8 experts.
constexpr int64_t kMinParallelWork = int64_t(1) << 16;

// Runs fn(i, tid) for i in [0, n) on up to `threads` threads, dynamically scheduled; tid in
// [0, threads) indexes per-thread scratch. It is this loop's own index, never a caller's (a
// caller may itself be inside an OpenMP region).
template <class Fn>
void parallel_for(int64_t n, int threads, const Fn& fn) {
#if defined(_OPENMP)
  if (threads > 1 && n > 1) {
    const int team = int(std::min<int64_t>(threads, n));  // no idle threads to wake
#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
    for (int64_t i = 0; i < n; ++i) {
      const int tid = omp_get_thread_num();
      fn(i, tid);
      CPUMOE_BENCH_TASK(tid);
    }
    return;
  }
#endif
  (void)threads;
  for (int64_t i = 0; i < n; ++i) {
    fn(i, 0);
    CPUMOE_BENCH_TASK(0);
  }
}

// parallel_for for a row phase of n items of about `work` elements each: one thread when the
// whole phase is small (results never depend on the thread count).
template <class Fn>
void parallel_rows(int64_t n, int64_t work, int threads, const Fn& fn) {
  parallel_for(n, n * work < kMinParallelWork ? 1 : threads, fn);
}

inline size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// The calling thread's scratch block. Grows, never shrinks (release_thread_scratch() frees it).
class ThreadScratch {
 public:
  ThreadScratch() = default;
  ~ThreadScratch() { std::free(p_); }
  ThreadScratch(const ThreadScratch&) = delete;
  ThreadScratch& operator=(const ThreadScratch&) = delete;

  // Makes the block at least `bytes` long; its first `keep` bytes survive a reallocation.
  uint8_t* reserve(size_t bytes, size_t keep) {
    if (bytes > cap_) {
      const size_t cap = align_up(bytes);
      auto* p = static_cast<uint8_t*>(std::aligned_alloc(kAlign, cap));
      if (p == nullptr) throw std::bad_alloc();
      if (keep > 0) std::memcpy(p, p_, std::min(keep, cap_));
      std::free(p_);
      p_ = p;
      cap_ = cap;
    }
    return p_;
  }
  size_t capacity() const { return cap_; }
  void release() {
    std::free(p_);
    p_ = nullptr;
    cap_ = 0;
  }

 private:
  uint8_t* p_ = nullptr;
  size_t cap_ = 0;
};

ThreadScratch& thread_scratch() {
  thread_local ThreadScratch s;
  return s;
}

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

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct Task {
  int64_t e, m0, m, n0, n;
};

// Column tile of a GEMM: a multiple of nr, at most 256 columns (the weight tile then stays in L2
// for any K we meet), and small enough that there are about 4 tasks per thread.
int64_t choose_n_tile(int64_t n, int64_t nr, int64_t row_tasks, int threads) {
  const int64_t want_tasks = 4 * int64_t(threads);
  int64_t tiles = std::max<int64_t>(1, ceil_div(want_tasks, std::max<int64_t>(1, row_tasks)));
  tiles = std::max(tiles, ceil_div(n, 256));
  const int64_t tile = round_up(ceil_div(n, tiles), nr);
  return std::max(nr, tile);
}

// Upper bound of the number of tasks of a GEMM over P rows in at most `experts` non-empty
// experts (each expert's last row chunk may be partial). choose_n_tile makes at most
// max(ceil(4 threads / row_tasks), ceil(n / 256)) tiles.
int64_t max_tasks(int64_t P, int64_t experts, int64_t n, int threads) {
  const int64_t row_tasks = ceil_div(P, kRowsPerTask) + experts;
  return std::max(4 * int64_t(threads) + row_tasks, row_tasks * ceil_div(n, 256));
}

// Bytes of the packed rows of one expert's slice of the lhs, as laid out in scratch.
template <class Kernel>
size_t lhs_bytes(const Kernel& kern, int64_t rows, int64_t depth) {
  return align_up(kern.lhs_packed_size(rows, depth));
}

// What the dispatcher needs to know about a kernel family besides its interface struct.
template <class Kernel>
struct Family;
template <>
struct Family<QGemmUkernel> {
  using Elem = int8_t;  // a GEMM input element: quantized
  using Packed = PackedMoe;
  static constexpr bool kQuantized = true;
};
template <>
struct Family<BGemmUkernel> {
  using Elem = uint16_t;  // bf16 bits
  using Packed = PackedMoeBf16;
  static constexpr bool kQuantized = false;
};

// Sizes that fix a chunk's scratch layout.
struct ChunkSizes {
  int64_t elem = 1;  // bytes of a GEMM input element (int8: 1, bf16: 2)
  int64_t E = 0, H = 0, I = 0, tc = 0, k = 0, threads = 1;
  int64_t P = 0;                  // routed slots
  size_t lhs1 = 0, lhs2 = 0;      // packed activations, all experts
  int64_t tasks1 = 0, tasks2 = 0; // GEMM tasks
};

// Byte offsets of every buffer of a chunk in its scratch block. The routing buffers come first:
// their size is known before routing, the rest only after. Then the buffers of phases 1-5, which
// are dead once GEMM2 starts, so GEMM2's output y reuses their space; then those that live on.
struct ChunkPlan {
  size_t count, first, fill, active, pos_of, token_of, route_end;
  size_t xq, xs, rows, row_scale, off1, lhs1, tasks1, h, qa, tmp;  // phases 1-5
  size_t y;                                                         // phases 6-7, over the above
  size_t sa, off2, lhs2, tasks2, accs;                              // written in 5 / 6, read after
  size_t total;
};

ChunkPlan plan(const ChunkSizes& s) {
  ChunkPlan p{};
  size_t at = 0;
  auto take = [&at](int64_t n, size_t elem) {
    const size_t o = at;
    at += align_up(size_t(n) * elem);
    return o;
  };
  const int64_t slots = s.tc * s.k;
  p.count = take(s.E, 8);
  p.first = take(s.E, 8);
  p.fill = take(s.E, 8);
  p.active = take(s.E, 8);
  p.pos_of = take(slots, 8);
  p.token_of = take(slots, 8);
  p.route_end = at;
  p.xq = take(s.tc * s.H, size_t(s.elem));
  p.xs = take(s.tc, 4);
  p.rows = take(s.P, sizeof(const void*));
  p.row_scale = take(s.P, 4);
  p.off1 = take(s.E, sizeof(size_t));
  p.lhs1 = take(int64_t(s.lhs1), 1);
  p.tasks1 = take(s.tasks1, sizeof(Task));
  p.h = take(s.P * 2 * s.I, 4);
  p.qa = take(s.P * s.I, size_t(s.elem));
  p.tmp = take(s.threads * s.I, 4);
  const size_t dead_end = at;
  at = p.route_end;
  p.y = take(s.P * s.H, 4);
  at = std::max(at, dead_end);
  p.sa = take(s.P, 4);
  p.off2 = take(s.E, sizeof(size_t));
  p.lhs2 = take(int64_t(s.lhs2), 1);
  p.tasks2 = take(s.tasks2, sizeof(Task));
  p.accs = take(s.threads * s.H, 4);
  p.total = at;
  return p;
}

int64_t tokens_per_chunk(int64_t k) { return std::max<int64_t>(1, kSlotsPerChunk / k); }

// The worst case over routings of a chunk of tc tokens: every slot routed to a local expert,
// spread over as many experts as possible. Packed lhs: a kernel packs m rows in at most
// lhs_packed_size(m) bytes and pads each expert's slice by less than one tile of mr rows
// (every layout of qgemm.h does), plus the 64-byte alignment of each slice.
template <class Kernel>
ChunkSizes worst_case(const Kernel& kern, int64_t E, int64_t H, int64_t I, int64_t tc,
                      int64_t k, int threads) {
  ChunkSizes s;
  s.elem = sizeof(typename Family<Kernel>::Elem);
  s.E = E;
  s.H = H;
  s.I = I;
  s.tc = tc;
  s.k = k;
  s.threads = threads;
  s.P = tc * k;
  const int64_t experts = std::min(E, s.P);
  s.lhs1 = align_up(kern.lhs_packed_size(s.P, H)) + size_t(experts) * lhs_bytes(kern, kern.mr, H);
  s.lhs2 = align_up(kern.lhs_packed_size(s.P, I)) + size_t(experts) * lhs_bytes(kern, kern.mr, I);
  s.tasks1 = max_tasks(s.P, experts, 2 * I, threads);
  s.tasks2 = max_tasks(s.P, experts, H, threads);
  return s;
}

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

// Bytes spanned by `rows` rows of `cols` elements of `elem` bytes at a row stride of `stride`.
int64_t span_bytes(int64_t rows, int64_t cols, int64_t stride, int64_t elem) {
  return ((rows - 1) * stride + cols) * elem;
}

bool overlap(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const auto* pa = static_cast<const uint8_t*>(a);
  const auto* pb = static_cast<const uint8_t*>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

template <class Packed>
void validate(const Packed& pk, const MoeCall& c) {
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
  // out is written while later chunks still read the inputs: it may share memory with none.
  const int64_t T = c.num_tokens;
  const int64_t es = dtype_size(c.dtype);
  const int64_t span_o = span_bytes(T, H, c.out_row_stride, es);
  if (overlap(c.out, span_o, c.x, span_bytes(T, H, c.x_row_stride, es)))
    fail("out: must not overlap x");
  if (overlap(c.out, span_o, c.topk_ids,
              span_bytes(T, c.topk, c.topk_ids_row_stride, c.topk_ids_int64 ? 8 : 4)))
    fail("out: must not overlap topk_ids");
  if (c.topk_weights != nullptr && !c.skip_weighted &&
      overlap(c.out, span_o, c.topk_weights, span_bytes(T, c.topk, c.topk_weights_row_stride, 4)))
    fail("out: must not overlap topk_weights");
  const int64_t E = pk.num_experts();
  const int64_t ids_bound = c.expert_map != nullptr ? c.num_global_experts : E;
  if (c.expert_map != nullptr) {
    if (c.num_global_experts < 1) fail("expert_map: num_global_experts must be >= 1");
    if (overlap(c.out, span_o, c.expert_map, c.num_global_experts * 4))
      fail("out: must not overlap expert_map");
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

// One chunk of tokens [t0, t0 + tc), all of its buffers in the calling thread's scratch block.
template <class Kernel>
struct Chunk {
  using Elem = typename Family<Kernel>::Elem;
  using Packed = typename Family<Kernel>::Packed;
  static constexpr bool kQuantized = Family<Kernel>::kQuantized;

  const Packed& pk;
  const MoeCall& c;
  const Kernel& kern;
  const RowOps& ro;  // the row operations that go with the kernel's ISA level
  int threads;
  int64_t t0, tc;
  int64_t E, H, I, k;
  ChunkSizes sizes;
  ChunkPlan pl{};
  uint8_t* base = nullptr;
  // Routing (valid after route()).
  int64_t P = 0;                  // slots routed to a local expert (all without an expert map)
  int64_t n_active = 0;           // experts with count > 0
  int64_t* count = nullptr;       // [E] slots per expert
  int64_t* first = nullptr;       // [E] first sorted position of each expert
  int64_t* active = nullptr;      // [n_active] experts with slots, ascending
  int64_t* pos_of = nullptr;      // [tc * k] slot (t * k + j, local t) -> sorted position or -1
  int64_t* token_of = nullptr;    // [P] sorted position -> local token

  Chunk(const Packed& p, const MoeCall& call, int th, int64_t t_begin, int64_t t_count)
      : pk(p), c(call), kern(p.kernel()), ro(*rowops_for(p.kernel().isa)), threads(th),
        t0(t_begin), tc(t_count), E(p.num_experts()), H(p.hidden()), I(p.intermediate()), k(call.topk) {
    sizes.elem = sizeof(Elem);
    sizes.E = E;
    sizes.H = H;
    sizes.I = I;
    sizes.tc = tc;
    sizes.k = k;
    sizes.threads = threads;
  }

  template <class T>
  T* at(size_t offset) const {
    return reinterpret_cast<T*>(base + offset);
  }

  void route() {
    pl = plan(sizes);  // P = 0 etc.: only the routing offsets are used yet
    base = thread_scratch().reserve(pl.route_end, 0);
    count = at<int64_t>(pl.count);
    first = at<int64_t>(pl.first);
    active = at<int64_t>(pl.active);
    pos_of = at<int64_t>(pl.pos_of);
    int64_t* fill = at<int64_t>(pl.fill);
    std::fill(count, count + E, int64_t(0));
    for (int64_t t = 0; t < tc; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = load_id(c, t0 + t, j);
        if (e >= 0) ++count[e];
      }
    }
    int64_t acc = 0;
    n_active = 0;
    for (int64_t e = 0; e < E; ++e) {
      first[e] = acc;
      fill[e] = acc;
      acc += count[e];
      if (count[e] > 0) active[n_active++] = e;
    }
    P = acc;
    token_of = at<int64_t>(pl.token_of);
    for (int64_t t = 0; t < tc; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = load_id(c, t0 + t, j);
        if (e < 0) {
          pos_of[t * k + j] = -1;
          continue;
        }
        const int64_t pos = fill[e]++;
        pos_of[t * k + j] = pos;
        token_of[pos] = t;
      }
    }
  }

  // Tasks over (expert, row chunk, column tile) for a GEMM with n output columns; writes them to
  // `out` when given, returns how many there are.
  int64_t make_tasks(int64_t n, Task* out) const {
    const int64_t rows_per_task = round_up(kRowsPerTask, kern.mr);
    int64_t row_tasks = 0;
    for (int64_t i = 0; i < n_active; ++i) row_tasks += ceil_div(count[active[i]], rows_per_task);
    const int64_t tile = choose_n_tile(n, kern.nr, row_tasks, threads);
    int64_t nt = 0;
    for (int64_t i = 0; i < n_active; ++i) {
      const int64_t e = active[i];
      for (int64_t m0 = 0; m0 < count[e]; m0 += rows_per_task)
        for (int64_t n0 = 0; n0 < n; n0 += tile) {
          if (out != nullptr)
            out[nt] = {e, m0, std::min(rows_per_task, count[e] - m0), n0, std::min(tile, n - n0)};
          ++nt;
        }
    }
    return nt;
  }

  // Byte offsets of each active expert's packed rows of depth `depth` (off[e]); returns the total.
  size_t lhs_offsets(int64_t depth, size_t* off) const {
    size_t acc = 0;
    for (int64_t i = 0; i < n_active; ++i) {
      off[active[i]] = acc;
      acc += lhs_bytes(kern, count[active[i]], depth);
    }
    return acc;
  }

  // Lays out the rest of the chunk now that the routing is known.
  void allocate() {
    sizes.P = P;
    for (int64_t i = 0; i < n_active; ++i) {
      sizes.lhs1 += lhs_bytes(kern, count[active[i]], H);
      sizes.lhs2 += lhs_bytes(kern, count[active[i]], I);
    }
    sizes.tasks1 = make_tasks(2 * I, nullptr);
    sizes.tasks2 = make_tasks(H, nullptr);
    const ChunkPlan full = plan(sizes);  // same routing offsets: they depend on E, tc, k only
    base = thread_scratch().reserve(full.total, full.route_end);
    pl = full;
    count = at<int64_t>(pl.count);
    first = at<int64_t>(pl.first);
    active = at<int64_t>(pl.active);
    pos_of = at<int64_t>(pl.pos_of);
    token_of = at<int64_t>(pl.token_of);
  }

  // Packs, per active expert, the rows rows[first[e] .. first[e] + count[e]).
  void pack_rows(const Elem* const* rows, int64_t depth, const size_t* off, uint8_t* dst) const {
    const int64_t work = depth * P / std::max<int64_t>(n_active, 1);  // per expert, on average
    parallel_rows(n_active, work, threads, [&](int64_t i, int) {
      const int64_t e = active[i];
      kern.pack_lhs(count[e], depth, rows + first[e], dst + off[e]);
    });
  }

  // scale(e) is only called for the quantized family (row_scale is null otherwise).
  template <class WeightsOf, class ScaleOf, class BiasOf>
  void gemm(int64_t n, int64_t depth, const uint8_t* lhs, const size_t* off, Task* tasks,
            int64_t n_tasks, const float* row_scale, float* dst, const WeightsOf& weights,
            const ScaleOf& scale, const BiasOf& bias) const {
    make_tasks(n, tasks);
    parallel_for(n_tasks, threads, [&](int64_t i, int tid) {
      const Task& tk = tasks[i];
      CPUMOE_BENCH_WORK(tid, (tk.m + 1) / 2 * ((tk.n + 1) / 2) * ((depth + 7) / 8));
      (void)tid;
      const int64_t row0 = first[tk.e] + tk.m0;
      const float* b = bias(tk.e);
      const uint8_t* lp = lhs + off[tk.e] + kern.lhs_packed_offset(tk.m0, depth);
      const uint8_t* rp =
          static_cast<const uint8_t*>(weights(tk.e)) + kern.rhs_packed_offset(tk.n0, depth);
      float* d = dst + row0 * n + tk.n0;
      if constexpr (kQuantized) {
        const QGemmEpilogue ep{row_scale + row0, scale(tk.e) + tk.n0, b ? b + tk.n0 : nullptr};
        kern.run_f32(tk.m, tk.n, depth, lp, rp, d, n, ep);
      } else {
        (void)row_scale;
        (void)scale;
        kern.run_f32(tk.m, tk.n, depth, lp, rp, d, n, b ? b + tk.n0 : nullptr);
      }
    });
  }

  // Scales of expert e's output channels (quantized family only).
  const float* scale13(int64_t e) const {
    if constexpr (kQuantized) return pk.s13(e);
    (void)e;
    return nullptr;
  }
  const float* scale2(int64_t e) const {
    if constexpr (kQuantized) return pk.s2(e);
    (void)e;
    return nullptr;
  }

  void run() {
    CPUMOE_BENCH_PHASE(route);
    route();
    allocate();
    const int64_t xes = dtype_size(c.dtype);

    // 1. Quantize (bf16: round) each token once. A bf16 x is used in place.
    Elem* xq = at<Elem>(pl.xq);
    float* xs = at<float>(pl.xs);
    const auto* x_bytes = static_cast<const uint8_t*>(c.x);
    const bool x_in_place = !kQuantized && c.dtype == DType::bf16;
    CPUMOE_BENCH_PHASE(quantize);
    if (!x_in_place) {
      parallel_rows(tc, H, threads, [&](int64_t t, int) {
        const uint8_t* row = x_bytes + (t0 + t) * c.x_row_stride * xes;
        if constexpr (kQuantized) {
          xs[t] = ro.quantize(row, c.dtype, H, xq + t * H);
        } else {
          ro.to_bf16(row, c.dtype, H, xq + t * H);
        }
      });
    }

    // 3. Gather each expert's token rows and pack them.
    CPUMOE_BENCH_PHASE(pack1);
    const Elem** rows = at<const Elem*>(pl.rows);
    float* row_scale = at<float>(pl.row_scale);
    for (int64_t p = 0; p < P; ++p) {
      const int64_t t = token_of[p];
      rows[p] = x_in_place
                    ? reinterpret_cast<const Elem*>(x_bytes + (t0 + t) * c.x_row_stride * xes)
                    : xq + t * H;
      if constexpr (kQuantized) row_scale[p] = xs[t];
    }
    size_t* off1 = at<size_t>(pl.off1);
    uint8_t* lhs1 = at<uint8_t>(pl.lhs1);
    lhs_offsets(H, off1);
    pack_rows(rows, H, off1, lhs1);

    // 4. GEMM1.
    CPUMOE_BENCH_PHASE(gemm1);
    float* h = at<float>(pl.h);
    gemm(2 * I, H, lhs1, off1, at<Task>(pl.tasks1), sizes.tasks1, row_scale, h,
         [&](int64_t e) { return pk.w13(e); }, [&](int64_t e) { return scale13(e); },
         [&](int64_t e) { return pk.b13(e); });

    // 5. Activation, then rounding to the input dtype and requantization (bf16: rounding to bf16).
    Elem* qa = at<Elem>(pl.qa);
    float* sa = at<float>(pl.sa);
    float* tmp = at<float>(pl.tmp);
    CPUMOE_BENCH_PHASE(activation);
    // work: the activation's polynomials cost several elements' worth per output.
    parallel_rows(P, 8 * I, threads, [&](int64_t p, int tid) {
      CPUMOE_BENCH_STEP(activation);
      if constexpr (kQuantized) {
        float* a = tmp + int64_t(tid) * I;  // the rounded row, quantized next
        const float amax = ro.activate_round(c.activation, h + p * 2 * I, I, c.dtype, a);
        CPUMOE_BENCH_STEP(requant);
        sa[p] = ro.quantize_with_amax(a, I, amax, qa + p * I);
      } else {
        (void)tid;
        ro.activate_bf16(c.activation, h + p * 2 * I, I, qa + p * I);
      }
    });
    CPUMOE_BENCH_PHASE(pack2);
    for (int64_t p = 0; p < P; ++p) rows[p] = qa + p * I;
    size_t* off2 = at<size_t>(pl.off2);
    uint8_t* lhs2 = at<uint8_t>(pl.lhs2);
    lhs_offsets(I, off2);
    pack_rows(rows, I, off2, lhs2);

    // 6. GEMM2.
    CPUMOE_BENCH_PHASE(gemm2);
    float* y = at<float>(pl.y);
    gemm(H, I, lhs2, off2, at<Task>(pl.tasks2), sizes.tasks2, sa, y,
         [&](int64_t e) { return pk.w2(e); }, [&](int64_t e) { return scale2(e); },
         [&](int64_t e) { return pk.b2(e); });

    // 7. Weighted combine, fp32, slots in their given order.
    CPUMOE_BENCH_PHASE(combine);
    float* accs = at<float>(pl.accs);
    parallel_rows(tc, k * H, threads, [&](int64_t t, int tid) {
      auto slot = [&](int64_t j, const float** yr, float* w) {
        if (pos_of[t * k + j] < 0) return false;  // expert not on this rank
        *w = c.skip_weighted ? 1.0f : c.topk_weights[(t0 + t) * c.topk_weights_row_stride + j];
        *yr = y + pos_of[t * k + j] * H;
        return true;
      };
      rowops::weighted_sum_row(k, slot, H, c.dtype,
                               static_cast<uint8_t*>(c.out) + (t0 + t) * c.out_row_stride * xes,
                               accs + int64_t(tid) * H, ro.weighted_sum_pass);
    });
  }
};

}  // namespace

float quantize_row(const void* x, DType dt, int64_t n, int8_t* q) {
  return rowops::quantize_row(x, dt, n, q);
}

template <class Kernel>
void PackedExperts<Kernel>::AlignedFree::operator()(void* p) const {
  std::free(p);
}

template <class Kernel>
template <class Elem>
PackedExperts<Kernel>::PackedExperts(int64_t e, int64_t h, int64_t i, const Kernel* kernel,
                                     const Elem* w13, const Elem* w2, const void* b13,
                                     DType b13_dtype, const void* b2, DType b2_dtype,
                                     int num_threads)
    : e_(e), h_(h), i_(i), kernel_(kernel) {
  if (e_ < 1) fail("w13: number of experts must be >= 1");
  if (h_ < kDimMultiple || h_ % kDimMultiple != 0)
    fail("w13: hidden size H = " + std::to_string(h_) + " must be a positive multiple of " +
         std::to_string(kDimMultiple));
  if (i_ < kDimMultiple || i_ % kDimMultiple != 0)
    fail("w2: intermediate size I = " + std::to_string(i_) + " must be a positive multiple of " +
         std::to_string(kDimMultiple));
  if (w13 == nullptr) fail("w13: missing");
  if (w2 == nullptr) fail("w2: missing");
  if (!cpu_supports(kernel_->isa))
    fail(std::string("isa: kernel ") + kernel_->name + " needs " + isa_name(kernel_->isa) +
         ", which this CPU lacks");

  const int threads = resolve_threads(num_threads);
  const Kernel& k = *kernel_;
  w13_stride_ = align_up(k.rhs_packed_size(2 * i_, h_));
  w2_stride_ = align_up(k.rhs_packed_size(h_, i_));
  w13_.reset(static_cast<uint8_t*>(std::aligned_alloc(kAlign, w13_stride_ * size_t(e_))));
  w2_.reset(static_cast<uint8_t*>(std::aligned_alloc(kAlign, w2_stride_ * size_t(e_))));
  if (!w13_ || !w2_) throw std::bad_alloc();
  parallel_for(e_, threads, [&](int64_t x, int) {
    k.pack_rhs(2 * i_, h_, w13 + x * 2 * i_ * h_, h_, w13_.get() + size_t(x) * w13_stride_);
    k.pack_rhs(h_, i_, w2 + x * h_ * i_, i_, w2_.get() + size_t(x) * w2_stride_);
  });
  if (b13 != nullptr) {
    b13_ = to_f32(b13, b13_dtype, e_ * 2 * i_);
    has_b13_ = true;
  }
  if (b2 != nullptr) {
    b2_ = to_f32(b2, b2_dtype, e_ * h_);
    has_b2_ = true;
  }
}

template <class Kernel>
PackedExperts<Kernel>::~PackedExperts() = default;

template <class Kernel>
size_t PackedExperts<Kernel>::packed_bytes() const {
  size_t n = (w13_stride_ + w2_stride_) * size_t(e_) + extra_bytes_;
  if (has_b13_) n += size_t(e_ * 2 * i_) * 4;
  if (has_b2_) n += size_t(e_ * h_) * 4;
  return n;
}

template <class Kernel>
const void* PackedExperts<Kernel>::w13(int64_t e) const {
  return w13_.get() + size_t(e) * w13_stride_;
}
template <class Kernel>
const void* PackedExperts<Kernel>::w2(int64_t e) const {
  return w2_.get() + size_t(e) * w2_stride_;
}

template class PackedExperts<QGemmUkernel>;
template class PackedExperts<BGemmUkernel>;

// The scales are checked before anything is packed (the base class packs in its constructor, so
// the check runs in the argument list).
static const MoeWeights& checked(const MoeWeights& w) {
  if (w.num_experts >= 1 && w.intermediate >= 1 && w.hidden >= 1) {
    check_scales(w.s13, w.num_experts * 2 * w.intermediate, "s13");
    check_scales(w.s2, w.num_experts * w.hidden, "s2");
  }
  return w;
}

PackedMoe::PackedMoe(const MoeWeights& w, const QGemmUkernel* kernel, int num_threads)
    : PackedExperts(checked(w).num_experts, w.hidden, w.intermediate,
                    kernel ? kernel : qgemm_select(), w.w13, w.w2, w.b13, w.b13_dtype, w.b2,
                    w.b2_dtype, num_threads) {
  const int64_t E = num_experts(), H = hidden(), I = intermediate();
  s13_.reset(new float[size_t(E * 2 * I)]);
  s2_.reset(new float[size_t(E * H)]);
  std::memcpy(s13_.get(), w.s13, size_t(E * 2 * I) * 4);
  std::memcpy(s2_.get(), w.s2, size_t(E * H) * 4);
  extra_bytes_ = size_t(E * (2 * I + H)) * 4;
}

PackedMoeBf16::PackedMoeBf16(const MoeWeightsBf16& w, const BGemmUkernel* kernel, int num_threads)
    : PackedExperts(w.num_experts, w.hidden, w.intermediate, kernel ? kernel : bgemm_select(),
                    w.w13, w.w2, w.b13, w.b13_dtype, w.b2, w.b2_dtype, num_threads) {}

namespace {

template <class Packed>
void run_op(const Packed& packed, const MoeCall& call) {
  using Kernel = std::decay_t<decltype(packed.kernel())>;
  validate(packed, call);
  if (call.num_tokens == 0) return;
  const int threads = resolve_threads(call.num_threads);
  const int64_t per_chunk = tokens_per_chunk(call.topk);
  for (int64_t t0 = 0; t0 < call.num_tokens; t0 += per_chunk) {
    Chunk<Kernel> chunk(packed, call, threads, t0, std::min(per_chunk, call.num_tokens - t0));
    chunk.run();
  }
}

template <class Kernel>
size_t scratch_bound(const Kernel& kernel, int64_t num_experts, int64_t hidden,
                     int64_t intermediate, int64_t num_tokens, int64_t topk, int num_threads) {
  if (num_experts < 1 || hidden < 1 || intermediate < 1)
    fail("packed: E, H and I must be >= 1");
  if (num_tokens < 0) fail("num_tokens: must be >= 0");
  if (topk < 1) fail("topk: must be >= 1, got " + std::to_string(topk));
  if (num_tokens == 0) return 0;
  const int64_t tc = std::min(num_tokens, tokens_per_chunk(topk));
  return plan(worst_case(kernel, num_experts, hidden, intermediate, tc, topk,
                         resolve_threads(num_threads)))
      .total;
}

}  // namespace

void fused_moe_int8(const PackedMoe& packed, const MoeCall& call) { run_op(packed, call); }

void fused_moe_bf16(const PackedMoeBf16& packed, const MoeCall& call) { run_op(packed, call); }

size_t fused_moe_scratch_bytes(const QGemmUkernel& kernel, int64_t num_experts, int64_t hidden,
                               int64_t intermediate, int64_t num_tokens, int64_t topk,
                               int num_threads) {
  return scratch_bound(kernel, num_experts, hidden, intermediate, num_tokens, topk, num_threads);
}

size_t fused_moe_scratch_bytes(const BGemmUkernel& kernel, int64_t num_experts, int64_t hidden,
                               int64_t intermediate, int64_t num_tokens, int64_t topk,
                               int num_threads) {
  return scratch_bound(kernel, num_experts, hidden, intermediate, num_tokens, topk, num_threads);
}

size_t fused_moe_scratch_bytes(const PackedMoe& packed, int64_t num_tokens, int64_t topk,
                               int num_threads) {
  return scratch_bound(packed.kernel(), packed.num_experts(), packed.hidden(),
                       packed.intermediate(), num_tokens, topk, num_threads);
}

size_t fused_moe_scratch_bytes(const PackedMoeBf16& packed, int64_t num_tokens, int64_t topk,
                               int num_threads) {
  return scratch_bound(packed.kernel(), packed.num_experts(), packed.hidden(),
                       packed.intermediate(), num_tokens, topk, num_threads);
}

size_t thread_scratch_bytes() { return thread_scratch().capacity(); }

void release_thread_scratch() { thread_scratch().release(); }

}  // namespace cpumoe
