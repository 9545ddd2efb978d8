// The scratch planner: the byte layout of a chunk's buffers in the calling thread's scratch block.
// One function, plan(), computes it both for a real routing and, through worst_case(), for the
// bound that fused_moe_scratch_bytes() reports, so the bound and the real use cannot drift apart.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cpumoe/moe.h"
#include "scratch.h"
#include "tiling.h"
#include "validate.h"

namespace cpumoe {
namespace moe_detail {

// Slots (token x expert pairs) per chunk: bounds scratch to a few tens of MB at typical shapes.
constexpr int64_t kSlotsPerChunk = 16384;

inline int64_t tokens_per_chunk(int64_t k) { return std::max<int64_t>(1, kSlotsPerChunk / k); }

// Sizes that fix a chunk's scratch layout.
struct ChunkSizes {
  int64_t elem = 1;  // bytes of a GEMM input element (int8: 1, bf16: 2)
  int64_t E = 0, H = 0, I = 0, tc = 0, k = 0, threads = 1;
  int64_t P = 0;                  // routed slots
  size_t lhs1 = 0, lhs2 = 0;      // packed activations, all experts
  int64_t tasks1 = 0, tasks2 = 0; // GEMM tasks
  size_t y_apart = 0;  // > 0: y gets this many bytes of its own after phases 1-5's buffers
                       // (GEMM2 runs inside phase 4's tasks: fuse_gemm2); 0: y reuses them
  size_t kscratch = 0;  // per thread: the GEMM kernel's scratch for one call (a 64-byte multiple,
                        // Family::kernel_scratch); the kernels never allocate
  // Affine weights (int4_affine): group sums per GEMM1 / GEMM2 input row (Family::groups), 0
  // for the other formats.
  int64_t groups1 = 0, groups2 = 0;
  // Activations quantized per group (ActQuant::group): scales per GEMM1 / GEMM2 input row
  // (Family::act_groups), 0 for one scale per row.
  int64_t agroups1 = 0, agroups2 = 0;
};

// Largest y (bytes) laid out apart for fuse_gemm2: decode and small batches, where the barrier
// between the GEMMs weighs, at a bounded cost in scratch (Qwen3: up to 256 slots).
constexpr size_t kFusedGemm2MaxY = size_t(2) << 20;

// Byte offsets of every buffer of a chunk in its scratch block. The routing buffers come first:
// their size is known before routing, the rest only after. Then the buffers of phases 1-5, which
// are dead once GEMM2 starts, so GEMM2's output y reuses their space (unless y_apart); then those
// that live on.
struct ChunkPlan {
  size_t count, first, fill, active, pos_of, token_of, route_end;
  size_t xq, xs, rows, row_scale, off1, lhs1, tasks1, h, qa, tmp;  // phases 1-5
  size_t xgs, gs1;  // [tc, agroups1] / [P, agroups1] fp32 group scales: written in 1 / 3, read in 4
  size_t y;  // phases 6-7, over the above (or after them: y_apart)
  size_t sa, off2, lhs2, tasks2, accs;                              // written in 5 / 6, read after
  size_t sums1, sums2;  // [P, groups1] / [P, groups2] fp32: written in 3 / 5, read in 4 / 6
  size_t gs2;           // [P, agroups2] fp32 group scales: written in 5, read in 6
  size_t kscratch;  // thread tid's kernel scratch at kscratch + tid * ChunkSizes::kscratch (4-6)
  size_t total;
};

ChunkPlan plan(const ChunkSizes& s);

// The most rows of one GEMM call in a chunk of tc tokens: a task's rows, at most the slots.
inline int64_t max_call_rows(const MoeTilePolicy& tp, int64_t mr, int64_t tc, int64_t k) {
  return std::min(rows_per_task(tp, mr), tc * k);
}

// The sizes known before routing (P, lhs and tasks stay 0); kscratch: the kernel's scratch per
// thread (Family::kernel_scratch at max_call_rows).
inline ChunkSizes chunk_sizes(int64_t elem, int64_t E, int64_t H, int64_t I, int64_t tc,
                              int64_t k, int threads, size_t kscratch) {
  ChunkSizes s;
  s.kscratch = kscratch;
  s.elem = elem;
  s.E = E;
  s.H = H;
  s.I = I;
  s.tc = tc;
  s.k = k;
  s.threads = threads;
  return s;
}

// Bytes of the packed rows of one expert's slice of the lhs, as laid out in scratch.
template <class Kernel>
size_t lhs_bytes(const Kernel& kern, int64_t rows, int64_t depth) {
  return align_up(kern.lhs_packed_size(rows, depth));
}

// The worst case over routings of a chunk of tc tokens: every slot routed to a local expert,
// spread over as many experts as possible. Packed lhs: a kernel packs m rows in at most
// lhs_packed_size(m) bytes and pads each expert's slice by less than one tile of mr rows
// (every layout of qgemm.h does), plus the 64-byte alignment of each slice.
template <class Kernel>
ChunkSizes worst_case(const MoeConfig<Kernel>& cfg, int64_t elem, int64_t E, int64_t H, int64_t I,
                      int64_t tc, int64_t k, int threads, size_t kscratch) {
  const Kernel& kern = *cfg.gemm;
  ChunkSizes s = chunk_sizes(elem, E, H, I, tc, k, threads, kscratch);
  s.P = checked_mul(tc, k, "scratch");
  // The kernels' size functions compute about m * depth * elem bytes (m rounded up to a tile of
  // at most 32 rows, elem <= 2) in 64 bits: keep that far from overflowing (a guard, not a size).
  for (int64_t depth : {H, I})
    checked_mul(checked_mul(checked_add(s.P, 64, "scratch"), checked_add(depth, 64, "scratch"),
                            "scratch"),
                64, "scratch");
  const int64_t experts = std::min(E, s.P);
  auto lhs_total = [&](int64_t depth) {
    const int64_t all = int64_t(align_up(kern.lhs_packed_size(s.P, depth)));
    const int64_t pad = checked_mul(experts, int64_t(lhs_bytes(kern, kern.mr, depth)), "scratch");
    return size_t(checked_add(all, pad, "scratch"));
  };
  s.lhs1 = lhs_total(H);
  s.lhs2 = lhs_total(I);
  s.tasks1 = max_tasks(cfg.tiles, s.P, experts, 2 * I, threads);
  s.tasks2 = max_tasks(cfg.tiles, s.P, experts, H, threads);
  return s;
}

}  // namespace moe_detail
}  // namespace cpumoe
