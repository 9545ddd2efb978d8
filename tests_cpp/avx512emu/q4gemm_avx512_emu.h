/// @file q4gemm_avx512_emu.h
/// The AVX-512 q4gemm kernels' code over SIMDe (q4gemm_avx512_simde.cpp), for the registry
/// tester on CPUs without AVX-512 (binary cpumoe_q4gemm_avx512emu_test).
#pragma once

#include "cpumoe/q4gemm.h"

namespace cpumoe_test {

extern const cpumoe::Q4GemmUkernel q4gemm_avx512_vnni_simde;

}  // namespace cpumoe_test
