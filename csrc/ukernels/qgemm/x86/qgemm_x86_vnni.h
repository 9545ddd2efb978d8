// The AVX-512 VNNI GEMM routines behind qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni, with the padded
// depth kp passed explicitly, so the AMX kernel (same `qu8r` / `qs8ci16x4s` layouts, kp padded to
// 64 for its tiles) can run its small-M rows and tails through them. Defined in
// qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni.cpp (built with the AVX-512 flags); callable only where
// cpu_supports(Isa::avx512_vnni) holds. No intrinsics here: any file may include it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpumoe/qgemm.h"

namespace cpumoe {
namespace x86_vnni {

/// Output columns of one packed B block.
constexpr int64_t kBlockCols = 16;

/// Bytes of one packed B block of depth kp (a multiple of 4): the 16 x kp weights, then the 16
/// int32 values 128 * column sum. A multiple of 64 for every kp.
inline constexpr int64_t rhs_block_bytes(int64_t kp) { return kBlockCols * kp + 64; }

/// @pre kp >= k, kp % 4 == 0. Row i of the result at i * kp: kp bytes of a + 128.
void pack_lhs(int64_t m, int64_t k, int64_t kp, const int8_t* const* rows, void* packed);
/// @pre kp >= k, kp % 4 == 0. ceil(n / 16) blocks of rhs_block_bytes(kp) bytes.
void pack_rhs(int64_t n, int64_t k, int64_t kp, const int8_t* rhs, int64_t stride, void* packed);
/// QGemmUkernel::run_f32 over packed operands of padded depth kp.
void run_f32(int64_t m, int64_t n, int64_t kp, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep);

}  // namespace x86_vnni
}  // namespace cpumoe
