/// @file f8gemm_avx512_emu.h
/// The AVX-512 f8gemm kernels' code over SIMDe (f8gemm_avx512_simde.cpp: VNNI's fp32 kernel,
/// f8gemm_avx512_bf16_simde.cpp: the BF16 one), for the registry tester on CPUs without AVX-512
/// (binary cpumoe_f8gemm_avx512emu_test).
#pragma once

#include "cpumoe/f8gemm.h"

namespace cpumoe_test {

extern const cpumoe::F8GemmUkernel f8gemm_avx512_vnni_simde;
extern const cpumoe::F8GemmUkernel f8gemm_avx512_bf16_simde;

}  // namespace cpumoe_test
