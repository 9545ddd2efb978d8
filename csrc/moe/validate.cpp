// Argument validation of the ops (validate.h).
#include "validate.h"

#include <cmath>

namespace cpumoe {
namespace moe_detail {
namespace {

// Bytes spanned by `rows` (>= 1) rows of `cols` elements of `elem` bytes at a row stride of
// `stride` (>= cols); an ArgumentError naming `what` when that leaves int64_t.
int64_t span_bytes(int64_t rows, int64_t cols, int64_t stride, int64_t elem, const char* what) {
  return checked_mul(checked_add(checked_mul(rows - 1, stride, what), cols, what), elem, what);
}

// In integers: pointer arithmetic past an object is undefined, and a bogus address plus a huge
// span may wrap (then the buffer cannot exist: an error).
bool overlap(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const auto pa = reinterpret_cast<uintptr_t>(a);
  const auto pb = reinterpret_cast<uintptr_t>(b);
  uintptr_t ea = 0, eb = 0;
  if (__builtin_add_overflow(pa, uintptr_t(a_bytes), &ea) ||
      __builtin_add_overflow(pb, uintptr_t(b_bytes), &eb))
    fail("out: a buffer of the call runs past the end of the address space");
  return pa < eb && pb < ea;
}

}  // namespace

void fail(const std::string& msg) { throw ArgumentError(msg); }

void fail_id(int64_t e, int64_t t, int64_t j, int64_t bound, bool changed) {
  fail("topk_ids: expert id " + std::to_string(e) + " at [" + std::to_string(t) + ", " +
       std::to_string(j) + "] is outside [0, " + std::to_string(bound) + ")" +
       (changed ? " (changed by another thread during the call?)" : ""));
}

void check_scales(const float* s, int64_t n, const char* name) {
  if (s == nullptr) fail(std::string(name) + ": missing");
  for (int64_t i = 0; i < n; ++i) {
    if (!(s[i] > 0.0f) || !std::isfinite(s[i]))
      fail(std::string(name) + ": every scale must be finite and > 0 (element " +
           std::to_string(i) + " is " + std::to_string(s[i]) + ")");
  }
}

void check_finite_scales(const float* s, int64_t n, const char* name) {
  if (s == nullptr) fail(std::string(name) + ": missing");
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(s[i]))
      fail(std::string(name) + ": every scale must be finite (element " + std::to_string(i) +
           " is " + std::to_string(s[i]) + ")");
  }
}

void validate(const MoeCall& c, int64_t E, int64_t H) {
  if (c.num_tokens < 0) fail("x: number of tokens must be >= 0");
  if (c.topk < 1) fail("topk_ids: k (columns of topk_ids) must be >= 1, got " + std::to_string(c.topk));
  if (c.skip_weighted && c.topk != 1)
    fail("skip_weighted: only allowed with k == 1 (got k = " + std::to_string(c.topk) + ")");
  if (int(c.activation.kind) < 0 || int(c.activation.kind) >= kNumActivations)
    fail("activation: unknown activation " + std::to_string(int(c.activation.kind)));
  const std::string act_problem = activation_spec_problem(c.activation);
  if (!act_problem.empty()) fail("activation: " + act_problem);
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
  const int64_t span_o = span_bytes(T, H, c.out_row_stride, es, "out");
  if (overlap(c.out, span_o, c.x, span_bytes(T, H, c.x_row_stride, es, "x")))
    fail("out: must not overlap x");
  if (overlap(c.out, span_o, c.topk_ids,
              span_bytes(T, c.topk, c.topk_ids_row_stride, c.topk_ids_int64 ? 8 : 4, "topk_ids")))
    fail("out: must not overlap topk_ids");
  if (c.topk_weights != nullptr && !c.skip_weighted &&
      overlap(c.out, span_o, c.topk_weights,
              span_bytes(T, c.topk, c.topk_weights_row_stride, 4, "topk_weights")))
    fail("out: must not overlap topk_weights");
  const int64_t ids_bound = c.expert_map != nullptr ? c.num_global_experts : E;
  if (c.expert_map != nullptr) {
    if (c.num_global_experts < 1) fail("expert_map: num_global_experts must be >= 1");
    if (overlap(c.out, span_o, c.expert_map, checked_mul(c.num_global_experts, 4, "expert_map")))
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
      if (e < 0 || e >= ids_bound) fail_id(e, t, j, ids_bound, false);
    }
  }
}

}  // namespace moe_detail
}  // namespace cpumoe
