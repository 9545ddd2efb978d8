// The scratch planner (plan.h): the layout of one chunk.
#include "plan.h"

#include <string>

#include "validate.h"

namespace cpumoe {
namespace moe_detail {

// Every product and sum is checked: E, H and I reach here from a caller of
// fused_moe_scratch_bytes() (or a hand-made layer), and a wrapped layout would be a small block
// written far past its end.
ChunkPlan plan(const ChunkSizes& s) {
  ChunkPlan p{};
  size_t at = 0;
  const char* what = "scratch";
  auto mul = [what](int64_t a, int64_t b) { return checked_mul(a, b, what); };
  auto take = [&at, what](int64_t n, size_t elem) {
    const size_t o = at;
    size_t bytes = 0;
    if (n < 0 || __builtin_mul_overflow(size_t(n), elem, &bytes) || bytes > (SIZE_MAX >> 1) ||
        __builtin_add_overflow(at, align_up(bytes), &at))
      fail(std::string(what) + ": the chunk's layout overflows size_t (sizes too large)");
    return o;
  };
  const int64_t slots = mul(s.tc, s.k);
  p.count = take(s.E, 8);
  p.first = take(s.E, 8);
  p.fill = take(s.E, 8);
  p.active = take(s.E, 8);
  p.pos_of = take(slots, 8);
  p.token_of = take(slots, 8);
  p.route_end = at;
  p.xq = take(mul(s.tc, s.H), size_t(s.elem));
  p.xs = take(s.tc, 4);
  p.rows = take(s.P, sizeof(const void*));
  p.row_scale = take(s.P, 4);
  p.off1 = take(s.E, sizeof(size_t));
  p.lhs1 = take(int64_t(s.lhs1), 1);
  p.tasks1 = take(s.tasks1, sizeof(Task));
  p.h = take(mul(s.P, mul(2, s.I)), 4);
  p.qa = take(mul(s.P, s.I), size_t(s.elem));
  p.tmp = take(mul(s.threads, s.I), 4);
  p.xgs = take(mul(s.tc, s.agroups1), 4);
  p.gs1 = take(mul(s.P, s.agroups1), 4);
  const size_t dead_end = at;
  if (s.y_apart > 0) {
    p.y = take(int64_t(s.y_apart), 1);
  } else {
    at = p.route_end;
    p.y = take(mul(s.P, s.H), 4);
    at = std::max(at, dead_end);
  }
  p.sa = take(s.P, 4);
  p.off2 = take(s.E, sizeof(size_t));
  p.lhs2 = take(int64_t(s.lhs2), 1);
  p.tasks2 = take(s.tasks2, sizeof(Task));
  p.accs = take(mul(s.threads, s.H), 4);
  p.sums1 = take(mul(s.P, s.groups1), 4);
  p.sums2 = take(mul(s.P, s.groups2), 4);
  p.gs2 = take(mul(s.P, s.agroups2), 4);
  // After y: GEMM2 writes y while its kernels use this.
  p.kscratch = take(mul(s.threads, int64_t(s.kscratch)), 1);
  p.total = at;
  return p;
}

}  // namespace moe_detail
}  // namespace cpumoe
