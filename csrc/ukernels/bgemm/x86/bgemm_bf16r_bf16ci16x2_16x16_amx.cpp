// bgemm_bf16r_bf16ci16x2_16x16_amx: the bf16 GEMM on AMX-BF16 tiles (Sapphire Rapids and later),
// with the AVX-512 BF16 kernel's layouts (K padded to 32, rows to 16), so calls of few rows run
// through that kernel. The logic is bgemm_amx.h's (layouts, tiles, edges, numerics), on the
// hardware tiles.
// Features used: AMX-TILE, AMX-BF16, AVX-512 F/BW/VL/BF16. The OS permission for the tile data is
// the amx level's enable step (isa_table.def).
#if !defined(__x86_64__) || !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || \
    !defined(__AMX_INT8__) || !defined(__AVX512F__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VL__) || !defined(__AVX512BF16__)
#error "bgemm_bf16r_bf16ci16x2_16x16_amx.cpp needs the amx level's flags (set per file by CMake)"
#endif

#include "ukernels/bgemm/x86/bgemm_amx.h"
#include "ukernels/common/x86/amx_hw.h"

namespace cpumoe {

extern const BGemmUkernel bgemm_bf16r_bf16ci16x2_16x16_amx = make_bgemm<bgemm_amx::Packing>(
    "bgemm_bf16r_bf16ci16x2_16x16_amx", Isa::amx, bgemm_amx::kMr,
    pack_lhs_bf16r<bgemm_amx::Packing>, pack_rhs_bf16c<bgemm_amx::Packing, 2>,
    bgemm_amx::run_f32<AmxHwTiles>);

}  // namespace cpumoe
