/// @file amx_probe.h
/// One tile instruction on one tile, on the hardware (amx_hw_probe.cpp, built where the amx
/// level is: CPUMOE_TEST_AMX_HW) and on the tile model (amx_model_kernels.cpp). Operands are
/// 16 rows of 64 bytes at stride 64: A (u8 / s8 / bf16 rows), B (k groups x 16 columns), C (int32 /
/// fp32, read and written). @p pairs: the k pairs of the bf16 product (1..16, the A tile's
/// bytes per row / 4).
#pragma once

namespace cpumoe_test {

void amx_hw_dpbusd(const void* a, const void* b, void* c);
void amx_hw_dpbssd(const void* a, const void* b, void* c);
void amx_hw_dpbf16ps(const void* a, const void* b, void* c, int pairs);
void amx_hw_storeconfig(void* cfg64);
void amx_hw_loadconfig(const void* cfg64);
void amx_hw_release();

void amx_model_dpbusd(const void* a, const void* b, void* c);
void amx_model_dpbssd(const void* a, const void* b, void* c);
void amx_model_dpbf16ps(const void* a, const void* b, void* c, int pairs);

}  // namespace cpumoe_test
