// Routing and task building of a chunk: a stable counting sort of its T*k slots by expert, and
// the GEMM tasks over (expert, row chunk, column tile) of the experts that received slots.
// Experts with no slots appear in no task.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpumoe/moe.h"
#include "plan.h"
#include "tiling.h"

namespace cpumoe {
namespace moe_detail {

// A chunk's routing, in its scratch block.
struct Routing {
  int64_t P = 0;                  // slots routed to a local expert (all without an expert map)
  int64_t n_active = 0;           // experts with count > 0
  int64_t* count = nullptr;       // [E] slots per expert
  int64_t* first = nullptr;       // [E] first sorted position of each expert
  int64_t* active = nullptr;      // [n_active] experts with slots, ascending
  int64_t* pos_of = nullptr;      // [tc * k] slot (t * k + j, local t) -> sorted position or -1
  int64_t* token_of = nullptr;    // [P] sorted position -> local token

  // Points the arrays at their places in a block laid out by `pl`.
  void bind(uint8_t* base, const ChunkPlan& pl);
};

// Sorts the slots of tokens [t0, t0 + tc) of call c over E local experts into r (bound to its
// block); fill is scratch of E entries. Reads each id (and its expert map entry) once and checks
// what it read: an ArgumentError if another thread made it invalid after validate().
void route(const MoeCall& c, int64_t t0, int64_t tc, int64_t E, int64_t* fill, Routing* r);

// Tasks of a GEMM with n output columns under the tile policy, cut in the kernel's mr x nr tiles;
// writes them to `out` when given, returns how many there are.
int64_t make_tasks(const Routing& r, const MoeTilePolicy& tp, int64_t mr, int64_t nr, int64_t n,
                   int threads, Task* out);

// Byte offsets of each active expert's packed rows of depth `depth` (off[e]); returns the total.
template <class Kernel>
size_t lhs_offsets(const Routing& r, const Kernel& kern, int64_t depth, size_t* off) {
  size_t acc = 0;
  for (int64_t i = 0; i < r.n_active; ++i) {
    if (off != nullptr) off[r.active[i]] = acc;
    acc += lhs_bytes(kern, r.count[r.active[i]], depth);
  }
  return acc;
}

}  // namespace moe_detail
}  // namespace cpumoe
