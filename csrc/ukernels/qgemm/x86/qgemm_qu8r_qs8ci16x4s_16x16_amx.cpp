// qgemm_qu8r_qs8ci16x4s_16x16_amx: the int8 GEMM on AMX-INT8 tiles (Sapphire Rapids and later),
// with the AVX-512 VNNI kernel's packing (K padded to 64, rows to 16), so calls of few rows run
// through that kernel. The logic is qgemm_amx.h's (layouts, tiles, edges), on the hardware tiles.
// Features used: AMX-TILE, AMX-INT8, AVX-512 F/BW/VL/VNNI. The OS permission for the tile data
// (arch_prctl ARCH_REQ_XCOMP_PERM) is the amx level's enable step (isa_table.def).
#if !defined(__x86_64__) || !defined(__AMX_TILE__) || !defined(__AMX_INT8__) || \
    !defined(__AMX_BF16__) || !defined(__AVX512F__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "qgemm_qu8r_qs8ci16x4s_16x16_amx.cpp needs the amx level's flags (set per file by CMake)"
#endif

#include "ukernels/common/x86/amx_hw.h"
#include "ukernels/qgemm/x86/qgemm_amx.h"

namespace cpumoe {

extern const QGemmUkernel qgemm_qu8r_qs8ci16x4s_16x16_amx = make_qgemm<qgemm_amx::Packing>(
    "qgemm_qu8r_qs8ci16x4s_16x16_amx", Isa::amx, qgemm_amx::kMr, qgemm_amx::pack_lhs,
    qgemm_amx::pack_rhs, qgemm_amx::run_f32<AmxHwTiles>);

}  // namespace cpumoe
