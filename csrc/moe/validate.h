// Argument checks of the ops (every error is an ArgumentError naming the argument, thrown before
// anything is written) and the reads of topk_ids they vouch for.
#pragma once

#include <cstdint>
#include <string>

#include "cpumoe/moe.h"

namespace cpumoe {
namespace moe_detail {

[[noreturn]] void fail(const std::string& msg);

// Every one of s[0..n) finite and > 0; `name` names the argument.
void check_scales(const float* s, int64_t n, const char* name);

// Checks a call on weights of E experts and hidden size H: shapes, strides, null pointers,
// overlaps of out with the inputs, expert ids and the expert map.
void validate(const MoeCall& c, int64_t E, int64_t H);

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

}  // namespace moe_detail
}  // namespace cpumoe
