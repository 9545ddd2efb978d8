// The AVX-512 f8gemm kernel's source built over SIMDe (portable implementations of the AVX-512
// intrinsics, Debian's libsimde-dev) instead of the hardware, so test_f8gemm.cpp's kernel tests run
// its decode, loops, tails and epilogue bit for bit on a CPU without AVX-512 (as
// q4gemm_avx512_simde.cpp does for the W4A8 kernel). Where the CPU has AVX-512,
// cpumoe_f8gemm_test runs the real kernel too. Built with the baseline flags: no AVX-512
// instruction can be in this object.
#if defined(__AVX512F__)
#error "f8gemm_avx512_simde.cpp must be built without AVX-512 flags (it runs the emulation)"
#endif

// GCC's own intrinsics first (their inline definitions claim the names), then SIMDe's
// implementations with its native-alias macros, which then win for every later use.
#include <immintrin.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cstdint>
#include <cstring>

#include "avx512emu/avx512_simde_shims.h"
#include "avx512emu/f8gemm_avx512_emu.h"

// The kernel file checks the ISA macros; from here on its intrinsics are SIMDe's.
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512VNNI__ 1
#define f8gemm_f32r_f8ck32_8x32_avx512_vnni f8gemm_avx512_vnni_simde_table
#include "ukernels/f8gemm/x86/f8gemm_f32r_f8ck32_8x32_avx512_vnni.cpp"
#undef f8gemm_f32r_f8ck32_8x32_avx512_vnni

namespace cpumoe_test {

// The same table, runnable on any CPU (isa portable) and named apart.
extern const cpumoe::F8GemmUkernel f8gemm_avx512_vnni_simde = [] {
  cpumoe::F8GemmUkernel k = cpumoe::f8gemm_avx512_vnni_simde_table;
  k.name = "f8gemm_f32r_f8ck32_8x32_avx512_vnni_simde";
  k.isa = cpumoe::Isa::portable;
  return k;
}();

}  // namespace cpumoe_test
