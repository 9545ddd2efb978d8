// q4gemm_qs8rs_q4cio32x4_8x32_avx512_vnni: the W4A8 GEMM (int8 activations x int4 / mxfp4 codes
// with group scales) on AVX-512 VNNI. The logic, layouts and loop are q4gemm_avx512_vnni.h's.
// Features used: AVX-512 F, BW, VL, VNNI.
#if !defined(__x86_64__) || !defined(__AVX512F__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "q4gemm_qs8rs_q4cio32x4_8x32_avx512_vnni.cpp needs -mavx512f -mavx512bw -mavx512vl -mavx512vnni (set per file by CMake)"
#endif

#include "ukernels/q4gemm/x86/q4gemm_avx512_vnni.h"

namespace cpumoe {

extern const Q4GemmUkernel q4gemm_qs8rs_q4cio32x4_8x32_avx512_vnni =
    make_q4gemm<Q4LhsRowSums, q4_vnni::Packing>(
        "q4gemm_qs8rs_q4cio32x4_8x32_avx512_vnni", Isa::avx512_vnni, q4_vnni::kMr, pack_lhs_qs8rs,
        pack_rhs_q4<q4_vnni::Packing, q4_vnni::HalvesInNibbles, q4_vnni::OffsetInt4>,
        q4_vnni::run_f32<false>);

}  // namespace cpumoe
