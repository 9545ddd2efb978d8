// Routing and task building (route.h).
#include "route.h"

#include <algorithm>

#include "validate.h"

namespace cpumoe {
namespace moe_detail {

void Routing::bind(uint8_t* base, const ChunkPlan& pl) {
  count = reinterpret_cast<int64_t*>(base + pl.count);
  first = reinterpret_cast<int64_t*>(base + pl.first);
  active = reinterpret_cast<int64_t*>(base + pl.active);
  pos_of = reinterpret_cast<int64_t*>(base + pl.pos_of);
  token_of = reinterpret_cast<int64_t*>(base + pl.token_of);
}

void route(const MoeCall& c, int64_t t0, int64_t tc, int64_t E, int64_t* fill, Routing* r) {
  const int64_t k = c.topk;
  int64_t* count = r->count;
  int64_t* local = r->pos_of;  // the checked local ids first; their sorted positions later
  std::fill(count, count + E, int64_t(0));
  // The only read of topk_ids and expert_map for routing: each id once, checked as copied, so
  // that a caller thread rewriting them meanwhile gets an error, never an index out of range.
  for (int64_t t = 0; t < tc; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = checked_local_id(c, E, load_raw_id(c, t0 + t, j), t0 + t, j);
      local[t * k + j] = e;
      if (e >= 0) ++count[e];
    }
  }
  int64_t acc = 0;
  r->n_active = 0;
  for (int64_t e = 0; e < E; ++e) {
    r->first[e] = acc;
    fill[e] = acc;
    acc += count[e];
    if (count[e] > 0) r->active[r->n_active++] = e;
  }
  r->P = acc;
  for (int64_t s = 0; s < tc * k; ++s) {
    const int64_t e = local[s];
    if (e < 0) continue;  // pos_of stays -1: the expert is on another rank
    const int64_t pos = fill[e]++;
    local[s] = pos;
    r->token_of[pos] = s / k;
  }
}

int64_t make_tasks(const Routing& r, const MoeTilePolicy& tp, int64_t mr, int64_t nr, int64_t n,
                   int threads, Task* out) {
  const int64_t rows = rows_per_task(tp, mr);
  int64_t row_tasks = 0;
  for (int64_t i = 0; i < r.n_active; ++i) row_tasks += ceil_div(r.count[r.active[i]], rows);
  const int64_t tile = choose_n_tile(tp, nr, n, row_tasks, threads);
  int64_t nt = 0;
  for (int64_t i = 0; i < r.n_active; ++i) {
    const int64_t e = r.active[i];
    for (int64_t m0 = 0; m0 < r.count[e]; m0 += rows)
      for (int64_t n0 = 0; n0 < n; n0 += tile) {
        if (out != nullptr)
          out[nt] = {e, m0, std::min(rows, r.count[e] - m0), n0, std::min(tile, n - n0)};
        ++nt;
      }
  }
  return nt;
}

}  // namespace moe_detail
}  // namespace cpumoe
