// Argument checks of the ops (every error is an ArgumentError naming the argument, thrown before
// anything is written) and the reads of topk_ids they vouch for.
#pragma once

#include <cstdint>
#include <string>

#include "cpumoe/moe.h"

namespace cpumoe {
namespace moe_detail {

[[noreturn]] void fail(const std::string& msg);

// a * b for sizes from the caller: an ArgumentError starting with `what` when an operand is
// negative or the product leaves int64_t (a wrapped size would mean a small allocation or a wild
// offset).
inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r))
    fail(std::string(what) + ": size " + std::to_string(a) + " * " + std::to_string(b) +
         " is negative or overflows int64");
  return r;
}

inline int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r))
    fail(std::string(what) + ": size " + std::to_string(a) + " + " + std::to_string(b) +
         " is negative or overflows int64");
  return r;
}

// Every one of s[0..n) finite and > 0; `name` names the argument.
void check_scales(const float* s, int64_t n, const char* name);
// Every one of s[0..n) finite (any sign, zero too: int4 group scales, which GGUF's Q4_0 stores
// negative for half of its blocks); `name` names the argument.
void check_finite_scales(const float* s, int64_t n, const char* name);

// Checks a call on weights of E experts and hidden size H: shapes, strides, null pointers,
// overlaps of out with the inputs, expert ids and the expert map. The ids and the map are caller
// memory that another thread may rewrite during the call, so route() does not trust this check:
// it copies each id once and checks the copy (check_id).
void validate(const MoeCall& c, int64_t E, int64_t H);

// The message of an expert id outside [0, bound) at [t, j] (t counted from the call's first token).
[[noreturn]] void fail_id(int64_t e, int64_t t, int64_t j, int64_t bound, bool changed);

// The local expert of id `raw` (global when an expert map is set) of slot [t, j], or -1 when the
// map puts it on another rank; an ArgumentError when the id or its map entry is out of range.
// Every value is read once: what is returned is what was checked.
inline int64_t checked_local_id(const MoeCall& c, int64_t E, int64_t raw, int64_t t, int64_t j) {
  const int64_t bound = c.expert_map != nullptr ? c.num_global_experts : E;
  if (raw < 0 || raw >= bound) fail_id(raw, t, j, bound, true);
  if (c.expert_map == nullptr) return raw;
  const int64_t e = c.expert_map[raw];
  if (e < -1 || e >= E)
    fail("expert_map: entry " + std::to_string(raw) + " is " + std::to_string(e) +
         ", outside [-1, " + std::to_string(E) + ") (changed by another thread during the call?)");
  return e;
}

// The id as given (global when an expert map is set).
inline int64_t load_raw_id(const MoeCall& c, int64_t t, int64_t j) {
  if (c.topk_ids_int64)
    return static_cast<const int64_t*>(c.topk_ids)[t * c.topk_ids_row_stride + j];
  return static_cast<const int32_t*>(c.topk_ids)[t * c.topk_ids_row_stride + j];
}

}  // namespace moe_detail
}  // namespace cpumoe
