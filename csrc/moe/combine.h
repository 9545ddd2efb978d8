// Step 7 of the pipeline, the weighted combine of one token's row: the slot walk around the row
// operations' weighted_sum_pass (RowOps), so the dispatcher needs no kernel-internal header.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpumoe/dtype.h"
#include "cpumoe/rowops.h"

namespace cpumoe {
namespace moe_detail {

/// The signature of RowOps::weighted_sum_pass.
using WeightedSumPass = decltype(RowOps::weighted_sum_pass);

/// dst = sum over the slots j < count with slot(j, &y, &w) true of w * y[0..n), in fp32, in
/// order from 0.0f (the bits of `acc = 0; for each slot: acc[i] += w * y[i]`), stored in dtype
/// dt; no slot: zeros. Up to 8 slots are summed in registers per pass over the row (by @p pass);
/// acc (n floats of scratch) carries the sums between passes when there are more.
template <class Slot>
inline void weighted_sum_row(int64_t count, const Slot& slot, int64_t n, DType dt, void* dst,
                             float* acc, WeightedSumPass pass) {
  constexpr int kFused = 8;
  const float* ys[kFused];
  float ws[kFused];
  int64_t j = 0;
  bool first = true;
  for (;;) {
    int nj = 0;
    for (; j < count && nj < kFused; ++j)
      if (slot(j, &ys[nj], &ws[nj])) ++nj;
    bool last = true;  // no valid slot after these?
    for (int64_t r = j; r < count && last; ++r) {
      const float* yr;
      float wr;
      last = !slot(r, &yr, &wr);
    }
    if (nj == 0) {  // no slot at all (nj is 0 only then): +0.0 in every dtype is all zero bits
      std::memset(dst, 0, size_t(n) * size_t(dtype_size(dt)));
      return;
    }
    pass(nj, ys, ws, n, first, last, dt, dst, acc);
    if (last) return;
    first = false;
  }
}

}  // namespace moe_detail
}  // namespace cpumoe
