/// @file f8gemm_avx512_emu.h
/// The AVX-512 f8gemm kernel's code over SIMDe (f8gemm_avx512_simde.cpp), for the registry tester
/// on CPUs without AVX-512 (binary cpumoe_f8gemm_avx512emu_test).
#pragma once

#include "cpumoe/f8gemm.h"

namespace cpumoe_test {

extern const cpumoe::F8GemmUkernel f8gemm_avx512_vnni_simde;

}  // namespace cpumoe_test
