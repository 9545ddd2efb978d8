// The AVX-512 BF16 f8gemm kernel's source built over SIMDe (and avx512_simde_shims.h's vdpbf16ps,
// checked bit for bit against the hardware), so test_f8gemm.cpp's kernel tests run its decode,
// expand-once panels, tails and epilogue on a CPU without AVX-512 BF16. A file of its own:
// the two f8gemm kernels' sources define the same internal names. Built with the baseline flags.
#include "avx512emu/f8gemm_avx512_emu.h"

#include "avx512emu/avx512_simde_kernel.h"

#define __AVX512BF16__ 1
// The kernel casts its integer vectors to __m512bh for vdpbf16ps; the shim takes them as they are.
#undef __m512bh
#define __m512bh simde__m512i

#define f8gemm_bf16r_f8ci32x2_12x32_avx512_bf16 f8gemm_avx512_bf16_simde_table
#include "ukernels/f8gemm/x86/f8gemm_bf16r_f8ci32x2_12x32_avx512_bf16.cpp"
#undef f8gemm_bf16r_f8ci32x2_12x32_avx512_bf16

namespace cpumoe_test {

extern const cpumoe::F8GemmUkernel f8gemm_avx512_bf16_simde = simde_table(
    cpumoe::f8gemm_avx512_bf16_simde_table, "f8gemm_bf16r_f8ci32x2_12x32_avx512_bf16_simde");

}  // namespace cpumoe_test
