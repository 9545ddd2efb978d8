// f8gemm_bf16r_f8ci32x2_16x32_amx: the W8A16 FP8 GEMM (bf16 activations x E4M3 codes with fp32
// block scales) on AMX-BF16 tiles (Sapphire Rapids and later): each group's codes expanded once
// per call into bf16 B tiles, tdpbf16ps per group, the scales applied with AVX-512. The logic is
// f8gemm_amx.h's (layouts, tiles, edges, numerics), on the hardware tiles.
// Features used: AMX-TILE, AMX-BF16, AVX-512 F/BW/VL/BF16. The OS permission for the tile data is
// the amx level's enable step (isa_table.def).
#if !defined(__x86_64__) || !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || \
    !defined(__AMX_INT8__) || !defined(__AVX512F__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VL__) || !defined(__AVX512BF16__)
#error "f8gemm_bf16r_f8ci32x2_16x32_amx.cpp needs the amx level's flags (set per file by CMake)"
#endif

#include "ukernels/common/x86/amx_hw.h"
#include "ukernels/f8gemm/x86/f8gemm_amx.h"

namespace cpumoe {

extern const F8GemmUkernel f8gemm_bf16r_f8ci32x2_16x32_amx = make_f8gemm<f8_amx::Packing>(
    "f8gemm_bf16r_f8ci32x2_16x32_amx", Isa::amx, f8_amx::kMr, pack_lhs_bf16r<f8_amx::Packing>,
    pack_rhs_f8<f8_amx::Packing, f8_bf16::Arrange>, f8_amx::run_f32<AmxHwTiles>,
    f8_amx::scratch_bytes);

}  // namespace cpumoe
