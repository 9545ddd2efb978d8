/// @file amx_model_kernels.h
/// The AMX kernels of csrc/ (qgemm_amx.h, bgemm_amx.h, q4gemm_amx.h, f8gemm_amx.h) instantiated
/// over the tile model (amx_tile_model.h) instead of the hardware tiles, as kernel interface
/// structs the registry testers run. Their `isa` is what they execute besides the model: AVX-512 VNNI (int8, W4A8) or
/// AVX-512 BF16 (bf16, fp8) for the epilogue and the few-row calls; the testers skip them elsewhere.
/// Defined only where the build has the avx512_bf16 level (CPUMOE_TEST_AMX_TILE_MODEL).
#pragma once

#include "cpumoe/bgemm.h"
#include "cpumoe/f8gemm.h"
#include "cpumoe/q4gemm.h"
#include "cpumoe/qgemm.h"

namespace cpumoe_test {

extern const cpumoe::QGemmUkernel qgemm_amx_tilemodel;
extern const cpumoe::BGemmUkernel bgemm_amx_tilemodel;
extern const cpumoe::Q4GemmUkernel q4gemm_amx_tilemodel;
extern const cpumoe::F8GemmUkernel f8gemm_amx_tilemodel;

/// Runs the model int8 kernel once (m = n = 32, k = 64, all-ones operands, 1.0 scales) on the
/// calling thread's model tiles as they are, and returns out[0][0] (64 when correct).
float amx_model_run_int8_once();
/// The calling thread's model tile configuration (64 bytes), and a way to set it.
void amx_model_storeconfig(void* cfg64);
void amx_model_loadconfig(const void* cfg64);

}  // namespace cpumoe_test
