// q4gemm_qs8rs_q4cio32x4_16x32_amx: the W4A8 GEMM on AMX-INT8 tiles (Sapphire Rapids and later),
// with the AVX-512 VNNI W4A8 kernel's packing (A's rows padded to 16), so calls of few rows run
// through that kernel. The logic is q4gemm_amx.h's (unpacking, tiles, groups), on the hardware
// tiles. Features used: AMX-TILE, AMX-INT8, AVX-512 F/BW/VL/VNNI. The OS permission for the tile
// data (arch_prctl ARCH_REQ_XCOMP_PERM) is the amx level's enable step (isa_table.def).
#if !defined(__x86_64__) || !defined(__AMX_TILE__) || !defined(__AMX_INT8__) || \
    !defined(__AMX_BF16__) || !defined(__AVX512F__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "q4gemm_qs8rs_q4cio32x4_16x32_amx.cpp needs the amx level's flags (set per file by CMake)"
#endif

#include "ukernels/common/x86/amx_hw.h"
#include "ukernels/q4gemm/x86/q4gemm_amx.h"

namespace cpumoe {

extern const Q4GemmUkernel q4gemm_qs8rs_q4cio32x4_16x32_amx =
    make_q4gemm<q4_amx::LhsPacking, q4_amx::Packing>(
        "q4gemm_qs8rs_q4cio32x4_16x32_amx", Isa::amx, q4_amx::kMr, q4_amx::pack_lhs,
        pack_rhs_q4<q4_amx::Packing, q4_vnni::HalvesInNibbles, q4_vnni::OffsetInt4>,
        q4_amx::run_f32<AmxHwTiles>, q4_amx::scratch_bytes);

}  // namespace cpumoe
