// The interface table of a GEMM microkernel (QGemmUkernel, BGemmUkernel: the same fields), from
// its packing P (kNr, kKr and the size / offset functions) and its own functions, so a kernel
// file ends in one definition line.
// Internal linkage on purpose: each kernel file is built with its own ISA flags (see
// qgemm/qgemm_common.h).
#pragma once

#include <cstdint>

#include "cpumoe/cpu_features.h"

namespace cpumoe {
namespace {

template <class Ukernel, class P>
constexpr Ukernel make_ukernel(const char* name, Isa isa, int64_t mr,
                               decltype(Ukernel::pack_lhs) pack_lhs,
                               decltype(Ukernel::pack_rhs) pack_rhs,
                               decltype(Ukernel::run_f32) run_f32) {
  return Ukernel{name,        isa,           mr,       P::kNr,  P::kKr,
                 P::lhs_size, P::lhs_offset, pack_lhs, P::rhs_size, P::rhs_offset,
                 pack_rhs,    run_f32};
}

}  // namespace
}  // namespace cpumoe
