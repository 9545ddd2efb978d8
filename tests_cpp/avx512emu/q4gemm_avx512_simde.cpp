// The AVX-512 VNNI q4gemm kernel's source built over SIMDe (portable implementations of the
// AVX-512 intrinsics, Debian's libsimde-dev) instead of the hardware, so the registry tester runs
// its loops, packing, tails and epilogue bit for bit on a CPU without AVX-512 (this and the
// x86-haswell machines). Where the CPU has AVX-512, cpumoe_q4gemm_test runs the real kernel too.
// Built with the baseline flags: no AVX-512 instruction can be in this object
// (avx512_simde_kernel.h).
#include "avx512emu/q4gemm_avx512_emu.h"

#include "avx512emu/avx512_simde_kernel.h"

#define q4gemm_qs8rs_q4cio32x4_8x32_avx512_vnni q4gemm_avx512_vnni_simde_table
#include "ukernels/q4gemm/x86/q4gemm_qs8rs_q4cio32x4_8x32_avx512_vnni.cpp"
#undef q4gemm_qs8rs_q4cio32x4_8x32_avx512_vnni

namespace cpumoe_test {

extern const cpumoe::Q4GemmUkernel q4gemm_avx512_vnni_simde = simde_table(
    cpumoe::q4gemm_avx512_vnni_simde_table, "q4gemm_qs8rs_q4cio32x4_8x32_avx512_vnni_simde");

}  // namespace cpumoe_test
