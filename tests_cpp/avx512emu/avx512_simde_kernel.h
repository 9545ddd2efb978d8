// What the AVX-512 kernel sources built over SIMDe share (q4gemm_avx512_simde.cpp,
// f8gemm_avx512_simde.cpp): SIMDe's intrinsics in place of the hardware's, and the ISA macros the
// kernel files check. Include it last but for the kernel's .cpp, which follows (its table renamed
// by a macro), then give the table its runnable copy with simde_table. Test-only; those files are
// built with the baseline flags: no AVX-512 instruction can be in their objects.
#pragma once

#if defined(__AVX512F__)
#error "the avx512emu kernel sources must be built without AVX-512 flags (they run the emulation)"
#endif

// GCC's own intrinsics first (their inline definitions claim the names), then SIMDe's
// implementations with its native-alias macros, which then win for every later use.
#include <immintrin.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cstdint>
#include <cstring>

#include "avx512emu/avx512_simde_shims.h"
#include "cpumoe/cpu_features.h"

namespace cpumoe_test {

// A copy of the kernel's table, runnable on any CPU (isa portable) and named apart.
template <class Ukernel>
Ukernel simde_table(Ukernel k, const char* name) {
  k.name = name;
  k.isa = cpumoe::Isa::portable;
  return k;
}

}  // namespace cpumoe_test

// The kernel file checks the ISA macros; from here on its intrinsics are SIMDe's.
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512VNNI__ 1
