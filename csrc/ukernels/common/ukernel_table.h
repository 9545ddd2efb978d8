// The interface table of a GEMM microkernel (QGemmUkernel, BGemmUkernel: the same fields), from
// its packing P (kNr, kKr and the size / offset functions) and its own functions, so a kernel
// file ends in one definition line; and TileFnGrid, the table of a kernel's register tiles by
// shape.
// Internal linkage on purpose: each kernel file is built with its own ISA flags (see
// qgemm/qgemm_common.h).
#pragma once

#include <array>
#include <cstdint>
#include <utility>

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

/// A kernel's register tiles by shape: table[MR - 1][NB - 1] = Pick::template fn<MR, NB>() for
/// MR in [1, Rows], NB in [1, Blocks] (Pick gives null for a tile its walk never asks for).
template <class Pick, class Fn, int Rows, int Blocks>
struct TileFnGrid {
  template <int MR, int... NB>
  static constexpr std::array<Fn, Blocks> row(std::integer_sequence<int, NB...>) {
    return {Pick::template fn<MR, NB + 1>()...};
  }
  template <int... MR>
  static constexpr auto make(std::integer_sequence<int, MR...>) {
    return std::array<std::array<Fn, Blocks>, sizeof...(MR)>{
        row<MR + 1>(std::make_integer_sequence<int, Blocks>{})...};
  }
  static constexpr auto table = make(std::make_integer_sequence<int, Rows>{});
};

}  // namespace
}  // namespace cpumoe
