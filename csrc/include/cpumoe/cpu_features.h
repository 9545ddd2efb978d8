/// @file cpu_features.h
/// What this CPU (and OS) can run, read once at run time, and the ISA levels the kernels are built
/// for. Built without any ISA flag: it runs before anything knows what the CPU has.
///
/// Arm: getauxval(AT_HWCAP / AT_HWCAP2), never /proc/cpuinfo (qemu-user shows the host's there).
/// x86: cpuid, plus XCR0 (xgetbv) for the OS's AVX / AVX-512 / AMX state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cpumoe {

/// Features of the running CPU that some kernel uses. Everything false on a CPU we know nothing of.
struct CpuFeatures {
  // AArch64
  bool neon = false;
  bool dotprod = false;  ///< FEAT_DotProd (SDOT/UDOT)
  bool i8mm = false;     ///< FEAT_I8MM (SMMLA/UMMLA/USMMLA)
  bool bf16 = false;     ///< FEAT_BF16 (BFMMLA/BFDOT)
  bool sve = false;
  // x86-64 (each true only if the OS also saves the register state)
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;  ///< VCVTPH2PS / VCVTPS2PH (the AVX2 row operations' f16 conversions)
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512vnni = false;
  bool avx512bf16 = false;
  bool avx_vnni = false;
  bool amx_tile = false;
  bool amx_int8 = false;
  bool amx_bf16 = false;
};

/// Reads the features once (thread-safe) and returns them.
const CpuFeatures& cpu_features();

/// "aarch64", "x86_64" or "other": the architecture this library was compiled for.
const char* target_arch();

/// ISA levels of the kernel ladder, one per row of cpumoe/isa_table.def (which also gives their
/// compile flags and CPU predicates). The numeric order within one architecture is the preference
/// order (higher = preferred); `portable` is the floor everywhere.
///  - AArch64: neon_i8mm (12) -> neon_bf16 (11) -> neon_dotprod (10) -> neon (9, plain Armv8.0
///    Advanced SIMD: every AArch64 CPU) -> portable.
///  - x86-64: amx (23) -> avx512_bf16 (22) -> avx512_vnni (21) -> avx2 (20) -> portable.
///    avx512_bf16 (VNNI plus VDPBF16PS) only has bf16-op kernels: the int8 op under that cap
///    runs avx512_vnni. amx (AMX-TILE, -INT8, -BF16 on top of avx512_bf16: Sapphire Rapids and
///    later) has kernels for both ops.
enum class Isa : int {
#define CPUMOE_ISA(name, value, ...) name = value,
#include "cpumoe/isa_table.def"
#undef CPUMOE_ISA
};

/// The level's name in isa_table.def ("portable", "neon_i8mm", ...); "?" for a value not in it.
const char* isa_name(Isa isa);

/// The ladder of this build's architecture, best first, `portable` last.
std::vector<Isa> isa_ladder();

/// Parses an ISA name of this architecture's ladder. Throws std::invalid_argument naming
/// @p what and the accepted names when @p name is not one of them.
Isa parse_isa(const std::string& name, const char* what);

/// True when the running CPU and OS state (XCR0) have what kernels of level @p isa execute: its
/// isa_table.def predicate and that of the level it requires. A pure query: no side effects (AMX
/// reports true here before the process has asked Linux for the tile state).
bool cpu_has(Isa isa);

/// True when this process can run kernels of level @p isa now: cpu_has(isa), and the level's
/// enable step done (isa_table.def; AMX: the tile-state permission, asked of Linux once per
/// process, on the first call for that level). Call it before running a kernel of the level;
/// the registries' select functions and the packed layers do.
bool cpu_supports(Isa isa);

/// The cap from the environment variable CPUMOE_ISA, read once; `nullptr` when unset or empty.
/// Throws std::invalid_argument for a value that is not an ISA name of this architecture.
const Isa* env_isa_cap();

}  // namespace cpumoe
