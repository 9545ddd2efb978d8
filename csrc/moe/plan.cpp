// The scratch planner (plan.h): the layout of one chunk.
#include "plan.h"

namespace cpumoe {
namespace moe_detail {

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

}  // namespace moe_detail
}  // namespace cpumoe
