// The AVX-512 f8gemm kernel's source built over SIMDe (portable implementations of the AVX-512
// intrinsics, Debian's libsimde-dev) instead of the hardware, so test_f8gemm.cpp's kernel tests run
// its decode, loops, tails and epilogue bit for bit on a CPU without AVX-512 (as
// q4gemm_avx512_simde.cpp does for the W4A8 kernel). Where the CPU has AVX-512,
// cpumoe_f8gemm_test runs the real kernel too. Built with the baseline flags: no AVX-512
// instruction can be in this object (avx512_simde_kernel.h).
#include "avx512emu/f8gemm_avx512_emu.h"

#include "avx512emu/avx512_simde_kernel.h"

#define f8gemm_f32r_f8ck32_8x32_avx512_vnni f8gemm_avx512_vnni_simde_table
#include "ukernels/f8gemm/x86/f8gemm_f32r_f8ck32_8x32_avx512_vnni.cpp"
#undef f8gemm_f32r_f8ck32_8x32_avx512_vnni

namespace cpumoe_test {

extern const cpumoe::F8GemmUkernel f8gemm_avx512_vnni_simde = simde_table(
    cpumoe::f8gemm_avx512_vnni_simde_table, "f8gemm_f32r_f8ck32_8x32_avx512_vnni_simde");

}  // namespace cpumoe_test
