/// @file moe_config.h
/// What every fused-MoE op shares before any weight is packed: the error type (ArgumentError),
/// the size rule (kDimMultiple), the tile policy and the chain a layer runs on (MoeConfig: the
/// GEMM kernel, the row operations and the tile policy, chosen once per layer for this CPU by
/// int8_config / w4_config / bf16_config / fp8_config). No ISA features.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "cpumoe/bgemm.h"
#include "cpumoe/f8gemm.h"
#include "cpumoe/q4gemm.h"
#include "cpumoe/qgemm.h"
#include "cpumoe/rowops.h"  // MoeConfig, kAmaxFloor

namespace cpumoe {

/// A bad argument value or shape: the message starts with the argument's name.
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// The hidden and intermediate sizes must be multiples of this (the rule every path shares; a
/// kernel that wants more pads internally).
constexpr int64_t kDimMultiple = 8;
// kAmaxFloor (the floor of a row's absolute maximum in quantization) comes from rowops.h.

/// How a layer cuts each GEMM into tasks over (expert, row chunk, column tile): part of its config.
/// The tasks, and so the order of every floating-point operation, follow from it and the routing.
struct MoeTilePolicy {
  int64_t rows = 256;  ///< rows of a task before rounding up to the kernel's mr: weights stream
                       ///< once per call for realistic tokens per expert, a huge expert still
                       ///< splits (column tiles are multiples of the kernel's nr)
  int64_t max_cols = 256;        ///< a column tile spans at most about this many columns (L2)
  int64_t tasks_per_thread = 4;  ///< ... and is small enough for about this many tasks per thread
  /// Calls with at least tasks_per_thread row tasks (expert, row chunk) per thread run GEMM1, the
  /// activation and the packing for GEMM2 in one task per row chunk, over all 2I columns, so
  /// GEMM1's output is read back from the core's cache instead of memory; smaller calls (decode)
  /// keep the column tiles that spread GEMM1 over the threads. Same results either way (every
  /// element is computed by the same kernel code in the same order); false: never.
  bool fuse_gemm1 = true;
  /// With fuse_gemm1 in effect, each row task also runs GEMM2 over all H columns of its rows:
  /// the whole call is one parallel loop, with no barrier between the GEMMs (at decode the
  /// team is woken once instead of twice and no thread waits for the slowest GEMM1 task).
  /// Same results either way; false: GEMM2 in column tiles after all row tasks.
  bool fuse_gemm2 = true;
};

/// The whole chain a packed layer runs, chosen once when it is packed and never looked up again
/// (XNNPACK's per-family config): the GEMM kernel, the row operations that go with its ISA level
/// (rowops_for), and the tile policy.
template <class Kernel>
struct MoeConfig {
  const Kernel* gemm = nullptr;
  const RowOps* rowops = nullptr;
  MoeTilePolicy tiles;
};

/// The int8 op's config for @p kernel; for nullptr, for qgemm_select(@p cap) (the best kernel
/// this CPU runs, capped by @p cap and CPUMOE_ISA). Never returns a null member.
MoeConfig<QGemmUkernel> int8_config(const QGemmUkernel* kernel, const Isa* cap = nullptr);
/// The bf16 op's config, as int8_config (bgemm_select).
MoeConfig<BGemmUkernel> bf16_config(const BGemmUkernel* kernel, const Isa* cap = nullptr);

/// The W4A8 op's config, as int8_config (q4gemm_select).
MoeConfig<Q4GemmUkernel> w4_config(const Q4GemmUkernel* kernel, const Isa* cap = nullptr);
/// The fp8 weights' config (the BF16 op's pipeline), as int8_config (f8gemm_select).
MoeConfig<F8GemmUkernel> fp8_config(const F8GemmUkernel* kernel, const Isa* cap = nullptr);

}  // namespace cpumoe
