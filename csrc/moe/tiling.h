// How a GEMM of the pipeline is cut into tasks, from the tile policy of the layer's config
// (MoeTilePolicy, chosen at prepack): tasks over (expert, row chunk, column tile).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpumoe/moe.h"

namespace cpumoe {
namespace moe_detail {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One GEMM task: rows [m0, m0 + m) of expert e's slice, output columns [n0, n0 + n).
struct Task {
  int64_t e, m0, m, n0, n;
};

// Rows of a task: the policy's row chunk rounded up to the kernel's register tile (mr rows).
inline int64_t rows_per_task(const MoeTilePolicy& tp, int64_t mr) { return round_up(tp.rows, mr); }

// Column tile of a GEMM of n columns over row_tasks row chunks: a multiple of the kernel's nr, at most
// max_cols columns, and small enough that there are about tasks_per_thread tasks per thread.
inline int64_t choose_n_tile(const MoeTilePolicy& tp, int64_t nr, int64_t n, int64_t row_tasks,
                             int threads) {
  const int64_t want_tasks = tp.tasks_per_thread * int64_t(threads);
  int64_t tiles = std::max<int64_t>(1, ceil_div(want_tasks, std::max<int64_t>(1, row_tasks)));
  tiles = std::max(tiles, ceil_div(n, tp.max_cols));
  const int64_t tile = round_up(ceil_div(n, tiles), nr);
  return std::max(nr, tile);
}

// Upper bound of the number of tasks of a GEMM over P rows in at most `experts` non-empty
// experts (each expert's last row chunk may be partial). choose_n_tile makes at most
// max(ceil(tasks_per_thread * threads / row_tasks), ceil(n / max_cols)) tiles.
inline int64_t max_tasks(const MoeTilePolicy& tp, int64_t P, int64_t experts, int64_t n,
                         int threads) {
  const int64_t row_tasks = ceil_div(P, tp.rows) + experts;
  return std::max(tp.tasks_per_thread * int64_t(threads) + row_tasks,
                  row_tasks * ceil_div(n, tp.max_cols));
}

}  // namespace moe_detail
}  // namespace cpumoe
