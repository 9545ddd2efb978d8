// The pipeline of one chunk of tokens [t0, t0 + tc), over the chain of the packed layer's config
// (GEMM kernel, row operations, tile policy). Phases (each parallel over independent tasks; every
// output element is computed by exactly one task in a fixed order, so results do not depend on
// the thread count):
//   route: stable counting sort of the tc*k slots by expert, then the scratch layout
//   1. quantize each token once                        xq [tc, H] int8, xs [tc]  (bf16: xq bf16;
//      ActQuant::group: xgs [tc, H / g] too, xs 1)
//   3. gather + pack each active expert's token rows for the kernel
//   4. GEMM1 tasks (expert, row chunk, column tile)     h [P, 2I] fp32 (P slots, in expert order)
//   5. activation, round to the input dtype, requantize qa [P, I] int8, sa [P]  (bf16: round to
//      bf16, qa bf16); pack again
//   4-5 fused (MoeTilePolicy::fuse_gemm1, calls with enough row chunks per thread): one task per
//      (expert, row chunk) runs GEMM1 over all 2I columns into a per-thread h block, activates
//      and requantizes those rows and packs them for GEMM2, so h never leaves the core's cache;
//      with fuse_gemm2 the same task then runs GEMM2 over all H columns of its rows (4-6 one
//      loop: no barrier between the GEMMs)
//   6. GEMM2 tasks                                      y [P, H] fp32
//   7. combine per token: out[t] = sum_j w[t,j] * y[slot(t,j)] in fp32, stored in the input dtype
// All buffers live in the calling thread's scratch block, laid out by plan(), the GEMM kernels'
// scratch too (a slice per thread: Family::kernel_scratch); nothing is allocated in between.
#pragma once

#include <algorithm>
#include <cstdint>

#include "bench_hooks.h"
#include "cpumoe/moe.h"
#include "combine.h"
#include "family.h"
#include "parallel.h"
#include "plan.h"
#include "route.h"
#include "scratch.h"

namespace cpumoe {
namespace moe_detail {

template <class Kernel>
class Pipeline {
  using F = Family<Kernel>;
  using Elem = typename F::Elem;
  using Packed = typename F::Packed;

 public:
  Pipeline(const Packed& p, const MoeCall& call, int th, int64_t t_begin, int64_t t_count)
      : pk(p), c(call), kern(*p.config().gemm), ro(*p.config().rowops), tp(p.config().tiles),
        threads(th), t0(t_begin), tc(t_count), E(p.num_experts()), H(p.hidden()),
        I(p.intermediate()), k(call.topk),
        sizes(chunk_sizes(sizeof(Elem), E, H, I, tc, k, threads,
                          F::kernel_scratch(kern, &p, max_call_rows(tp, kern.mr, tc, k), H, I))) {
    sizes.groups1 = F::groups(&p, H);
    sizes.groups2 = F::groups(&p, I);
    sizes.agroups1 = F::act_groups(&p, H);
    sizes.agroups2 = F::act_groups(&p, I);
  }

  // The phases in order; the one bench-hook phase marker stands here.
  void run() {
    using Step = void (Pipeline::*)();
    static constexpr struct {
      int phase;
      Step step;
    } kPhases[] = {{bench_hooks::route, &Pipeline::route_and_allocate},
                   {bench_hooks::quantize, &Pipeline::quantize_x},
                   {bench_hooks::pack1, &Pipeline::pack1},
                   {bench_hooks::gemm1, &Pipeline::gemm1},
                   {bench_hooks::activation, &Pipeline::activate},
                   {bench_hooks::pack2, &Pipeline::pack2},
                   {bench_hooks::gemm2, &Pipeline::gemm2},
                   {bench_hooks::combine, &Pipeline::combine}};
    for (const auto& ph : kPhases) {
      CPUMOE_BENCH_PHASE(ph.phase);
      (this->*ph.step)();
    }
  }

 private:
  template <class T>
  T* at(size_t offset) const {
    return reinterpret_cast<T*>(base + offset);
  }

  // Thread tid's kernel scratch (ChunkSizes::kscratch bytes, 64-byte aligned) for its GEMM calls.
  void* kernel_scratch(int tid) const {
    return base + pl.kscratch + size_t(tid) * sizes.kscratch;
  }

  const uint8_t* x_row(int64_t t) const {
    return static_cast<const uint8_t*>(c.x) + (t0 + t) * c.x_row_stride * dtype_size(c.dtype);
  }

  // Routes with only the routing part of the block reserved, then lays out the rest.
  void route_and_allocate() {
    pl = plan(sizes);  // P = 0 etc.: only the routing offsets are used yet
    base = thread_scratch().reserve(pl.route_end, 0);
    r.bind(base, pl);
    route(c, t0, tc, E, at<int64_t>(pl.fill), &r);
    sizes.P = r.P;
    sizes.lhs1 = lhs_offsets(r, kern, H, nullptr);
    sizes.lhs2 = lhs_offsets(r, kern, I, nullptr);
    sizes.tasks1 = make_tasks(r, tp, kern.mr, kern.nr, 2 * I, threads, nullptr);
    sizes.tasks2 = make_tasks(r, tp, kern.mr, kern.nr, H, threads, nullptr);
    fused = tp.fuse_gemm1 && row_tasks(nullptr) >= tp.tasks_per_thread * int64_t(threads);
    // GEMM2 in the row tasks needs y apart from the buffers other tasks still read.
    const size_t y_bytes = size_t(r.P) * size_t(H) * sizeof(float);
    fused2 = fused && tp.fuse_gemm2 && y_bytes <= kFusedGemm2MaxY;
    sizes.y_apart = fused2 ? std::max<size_t>(y_bytes, 1) : 0;
    pl = plan(sizes);  // same routing offsets: they depend on E, tc, k only
    base = thread_scratch().reserve(pl.total, pl.route_end);
    r.bind(base, pl);
    x_in_place = F::x_in_place(c.dtype);
  }

  // The (expert, row chunk) tasks of the fused phases 4-5 (all 2I columns each) into `out` when
  // given; returns their number (at most that of GEMM1's tasks, whose space they use).
  int64_t row_tasks(Task* out) const {
    const int64_t rows = rows_per_task(tp, kern.mr);
    int64_t nt = 0;
    for (int64_t i = 0; i < r.n_active; ++i) {
      const int64_t e = r.active[i];
      for (int64_t m0 = 0; m0 < r.count[e]; m0 += rows, ++nt)
        if (out != nullptr) out[nt] = {e, m0, std::min(rows, r.count[e] - m0), 0, 2 * I};
    }
    return nt;
  }

  // Row p's group scales in a [rows, groups] buffer at `at_`, nullptr when there are none.
  float* group_scales(size_t at_, int64_t groups, int64_t p) const {
    return groups > 0 ? at<float>(at_) + p * groups : nullptr;
  }

  // 1. Quantize (bf16: round) each token once. A bf16 x is used in place.
  void quantize_x() {
    if (x_in_place) return;
    Elem* xq = at<Elem>(pl.xq);
    float* xs = at<float>(pl.xs);
    parallel_rows(tc, H, threads, [&](int64_t t, int) {
      F::input_row(ro, x_row(t), c.dtype, H, xq + t * H, xs + t,
                   group_scales(pl.xgs, sizes.agroups1, t), sizes.agroups1);
    });
  }

  // Packs, per active expert, the rows rows[first[e] .. first[e] + count[e]) of depth `depth`.
  void pack_rows(int64_t depth, size_t lhs_at, size_t off_at) {
    const Elem* const* rows = at<const Elem*>(pl.rows);
    size_t* off = at<size_t>(off_at);
    uint8_t* dst = at<uint8_t>(lhs_at);
    lhs_offsets(r, kern, depth, off);
    const int64_t work = depth * r.P / std::max<int64_t>(r.n_active, 1);  // per expert, on average
    parallel_rows(r.n_active, work, threads, [&](int64_t i, int) {
      const int64_t e = r.active[i];
      kern.pack_lhs(r.count[e], depth, rows + r.first[e], dst + off[e]);
    });
  }

  // 3. Gather each expert's token rows and pack them.
  void pack1() {
    const Elem** rows = at<const Elem*>(pl.rows);
    const Elem* xq = at<Elem>(pl.xq);
    const float* xs = at<float>(pl.xs);
    float* row_scale = at<float>(pl.row_scale);
    for (int64_t p = 0; p < r.P; ++p) {
      const int64_t t = r.token_of[p];
      rows[p] = x_in_place ? reinterpret_cast<const Elem*>(x_row(t)) : xq + t * H;
      F::gather_scale(row_scale + p, xs + t);
      if (sizes.agroups1 > 0)
        std::copy_n(group_scales(pl.xgs, sizes.agroups1, t), sizes.agroups1,
                    group_scales(pl.gs1, sizes.agroups1, p));
    }
    if (sizes.groups1 > 0) {
      float* sums1 = at<float>(pl.sums1);
      parallel_rows(r.P, H, threads, [&](int64_t p, int) {
        F::sums(ro, pk, rows[p], H, sums1 + p * sizes.groups1,
                group_scales(pl.gs1, sizes.agroups1, p));
      });
    }
    pack_rows(H, pl.lhs1, pl.off1);
  }

  // One GEMM over the tasks at tasks_at: dst [P, n] from the packed rows of depth `depth`.
  // sums: the input rows' group sums ([P, groups]; groups 0: none); gs_at: their group scales
  // ([P, agroups]; agroups 0: none).
  template <class WeightsOf, class ScaleOf, class BiasOf>
  void gemm(int64_t n, int64_t depth, size_t lhs_at, size_t off_at, size_t tasks_at,
            int64_t n_tasks, const float* row_scale, size_t gs_at, int64_t agroups,
            const float* sums, int64_t groups, float* dst, const WeightsOf& weights,
            const ScaleOf& scale, const BiasOf& bias, bool stream = false) const {
    const uint8_t* lhs = at<uint8_t>(lhs_at);
    const size_t* off = at<size_t>(off_at);
    Task* tasks = at<Task>(tasks_at);
    make_tasks(r, tp, kern.mr, kern.nr, n, threads, tasks);
    parallel_for(n_tasks, threads, [&](int64_t i, int tid) -> int64_t {
      const Task& tk = tasks[i];
      const int64_t row0 = r.first[tk.e] + tk.m0;
      const uint8_t* lp = lhs + off[tk.e] + kern.lhs_packed_offset(tk.m0, depth);
      const uint8_t* rp =
          static_cast<const uint8_t*>(weights(tk.e)) + F::rhs_offset(kern, pk, tk.n0, depth);
      F::run(kern, pk, tk, n, depth, sums + row0 * groups, lp, rp, dst + row0 * n + tk.n0, n,
             row_scale + row0, group_scales(gs_at, agroups, row0), scale(tk.e), bias(tk.e),
             kernel_scratch(tid), stream);
      // The task's work for the bench hooks: multiply-adds over the kernel's padded tiles.
      return round_up(tk.m, kern.mr) * round_up(tk.n, kern.nr) * round_up(depth, kern.kr);
    });
  }

  // 4. GEMM1 (or 4-5 fused).
  void gemm1() {
    if (fused) {
      gemm1_activate_pack();
      return;
    }
    gemm(2 * I, H, pl.lhs1, pl.off1, pl.tasks1, sizes.tasks1, at<float>(pl.row_scale), pl.gs1,
         sizes.agroups1, at<float>(pl.sums1), sizes.groups1, at<float>(pl.h), [&](int64_t e) { return pk.w13(e); },
         [&](int64_t e) { return F::scale13(pk, e); }, [&](int64_t e) { return pk.b13(e); });
  }

  // 4-5 fused: per row task, GEMM1 over all columns, the activation of its rows and their
  // packing for GEMM2. h: a block of rows_per_task rows per thread where P has room for them
  // (reused by each task of the thread, so it stays in its cache), else the task's own rows.
  void gemm1_activate_pack() {
    const uint8_t* lhs1 = at<uint8_t>(pl.lhs1);
    const size_t* off1 = at<size_t>(pl.off1);
    uint8_t* lhs2 = at<uint8_t>(pl.lhs2);
    size_t* off2 = at<size_t>(pl.off2);
    lhs_offsets(r, kern, I, off2);
    Task* tasks = at<Task>(pl.tasks1);
    const int64_t n_tasks = row_tasks(tasks);
    const float* row_scale = at<float>(pl.row_scale);
    float* h = at<float>(pl.h);
    float* y = at<float>(pl.y);
    Elem* qa = at<Elem>(pl.qa);
    float* sa = at<float>(pl.sa);
    float* tmp = at<float>(pl.tmp);
    const Elem** rows = at<const Elem*>(pl.rows);  // pack1 is done with them
    const float* sums1 = at<float>(pl.sums1);
    float* sums2 = at<float>(pl.sums2);
    const int64_t rows_per = rows_per_task(tp, kern.mr);
    const bool thread_h = int64_t(threads) * rows_per <= r.P;
    parallel_for(n_tasks, threads, [&](int64_t i, int tid) -> int64_t {
      const Task& tk = tasks[i];
      const int64_t row0 = r.first[tk.e] + tk.m0;
      float* ht = thread_h ? h + int64_t(tid) * rows_per * 2 * I : h + row0 * 2 * I;
      F::run(kern, pk, tk, 2 * I, H, sums1 + row0 * sizes.groups1,
             lhs1 + off1[tk.e] + kern.lhs_packed_offset(tk.m0, H), pk.w13(tk.e), ht, 2 * I,
             row_scale + row0, group_scales(pl.gs1, sizes.agroups1, row0),
             F::scale13(pk, tk.e), pk.b13(tk.e), kernel_scratch(tid));
      for (int64_t p = 0; p < tk.m; ++p) {
        float* gs = group_scales(pl.gs2, sizes.agroups2, row0 + p);
        F::activate(ro, c.activation, ht + p * 2 * I, I, c.dtype, tmp + int64_t(tid) * I,
                    qa + (row0 + p) * I, sa + row0 + p, gs, sizes.agroups2);
        rows[row0 + p] = qa + (row0 + p) * I;
        if (sizes.groups2 > 0)
          F::sums(ro, pk, qa + (row0 + p) * I, I, sums2 + (row0 + p) * sizes.groups2, gs);
      }
      uint8_t* lp2 = lhs2 + off2[tk.e] + kern.lhs_packed_offset(tk.m0, I);
      kern.pack_lhs(tk.m, I, rows + row0, lp2);
      int64_t work = round_up(tk.m, kern.mr) * round_up(2 * I, kern.nr) * round_up(H, kern.kr);
      if (fused2) {  // GEMM2 of these rows, all H columns (a task of phase 6 spanning them all)
        const Task t2{tk.e, tk.m0, tk.m, 0, H};
        F::run(kern, pk, t2, H, I, sums2 + row0 * sizes.groups2, lp2, pk.w2(tk.e), y + row0 * H, H,
               sa + row0, group_scales(pl.gs2, sizes.agroups2, row0), F::scale2(pk, tk.e),
               pk.b2(tk.e), kernel_scratch(tid));
        work += round_up(tk.m, kern.mr) * round_up(H, kern.nr) * round_up(I, kern.kr);
      }
      return work;
    });
  }

  // 5. Activation, then rounding to the input dtype and requantization (bf16: rounding to bf16).
  void activate() {
    if (fused) return;
    const float* h = at<float>(pl.h);
    Elem* qa = at<Elem>(pl.qa);
    float* sa = at<float>(pl.sa);
    float* tmp = at<float>(pl.tmp);
    float* sums2 = at<float>(pl.sums2);
    // work: the activation's polynomials cost several elements' worth per output.
    parallel_rows(r.P, 8 * I, threads, [&](int64_t p, int tid) {
      CPUMOE_BENCH_STEP(bench_hooks::activation);
      float* gs = group_scales(pl.gs2, sizes.agroups2, p);
      F::activate(ro, c.activation, h + p * 2 * I, I, c.dtype, tmp + int64_t(tid) * I,
                  qa + p * I, sa + p, gs, sizes.agroups2);
      if (sizes.groups2 > 0) F::sums(ro, pk, qa + p * I, I, sums2 + p * sizes.groups2, gs);
    });
  }

  // 5, end. Pack the activated rows for GEMM2.
  void pack2() {
    if (fused) return;
    const Elem** rows = at<const Elem*>(pl.rows);
    const Elem* qa = at<Elem>(pl.qa);
    for (int64_t p = 0; p < r.P; ++p) rows[p] = qa + p * I;
    pack_rows(I, pl.lhs2, pl.off2);
  }

  // 6. GEMM2.
  void gemm2() {
    if (fused2) return;
    // y is read by the combine only after the whole GEMM: when it is larger than a few cores'
    // L2, its lines go past the caches rather than evicting the weights (the hint).
    // (Measured, AMX, one thread, Qwen3 T=2048: 240 -> 197 ms median of 3; T=512: neutral.)
    const bool stream = size_t(r.P) * size_t(H) * sizeof(float) >= kStreamBytes;
    gemm(H, I, pl.lhs2, pl.off2, pl.tasks2, sizes.tasks2, at<float>(pl.sa), pl.gs2,
         sizes.agroups2, at<float>(pl.sums2),
         sizes.groups2, at<float>(pl.y),
         [&](int64_t e) { return pk.w2(e); }, [&](int64_t e) { return F::scale2(pk, e); },
         [&](int64_t e) { return pk.b2(e); }, stream);
  }
  static constexpr size_t kStreamBytes = size_t(8) << 20;

  // 7. Weighted combine, fp32, slots in their given order.
  void combine() {
    const float* y = at<float>(pl.y);
    float* accs = at<float>(pl.accs);
    const int64_t xes = dtype_size(c.dtype);
    parallel_rows(tc, k * H, threads, [&](int64_t t, int tid) {
      auto slot = [&](int64_t j, const float** yr, float* w) {
        if (r.pos_of[t * k + j] < 0) return false;  // expert not on this rank
        *w = c.skip_weighted ? 1.0f : c.topk_weights[(t0 + t) * c.topk_weights_row_stride + j];
        *yr = y + r.pos_of[t * k + j] * H;
        return true;
      };
      weighted_sum_row(k, slot, H, c.dtype,
                       static_cast<uint8_t*>(c.out) + (t0 + t) * c.out_row_stride * xes,
                       accs + int64_t(tid) * H, ro.weighted_sum_pass);
    });
  }

  const Packed& pk;
  const MoeCall& c;
  const Kernel& kern;
  const RowOps& ro;
  const MoeTilePolicy& tp;
  int threads;
  int64_t t0, tc;
  int64_t E, H, I, k;
  ChunkSizes sizes;
  ChunkPlan pl{};
  uint8_t* base = nullptr;
  Routing r;
  bool x_in_place = false;
  bool fused = false;   // phases 4-5 as one loop of row tasks
  bool fused2 = false;  // ... and phase 6 in the same tasks
};

}  // namespace moe_detail
}  // namespace cpumoe
