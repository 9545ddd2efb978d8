// The logic of qgemm_qu8r_qs8ci16x4s_16x16_amx over amx_gemm.h's Tiles class: the kernel file
// instantiates it with the hardware tiles (amx_hw.h), the tests with the tile model
// (tests_cpp/amx/amx_tile_model.h), so both run exactly this code.
//
// tdpbusd multiplies a 16 x 64 tile of unsigned bytes (16 rows of A, 64 k) by a 16 x 64 tile of
// signed bytes (16 groups of 4 k, each 16 columns x 4 bytes) into a 16 x 16 int32 tile. Those are
// the `qu8r` / `qs8ci16x4s` layouts of qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni with the depth padded
// to kp = round_up(k, 64) and the rows to a multiple of 16 (zero rows): an A tile is 16 packed
// rows at stride kp, a B tile 16 consecutive 64-byte groups of one column block. tdpbusd (u8 x s8)
// rather than tdpbssd: with the shifted A and the column sums both kernels share one packing, and
// calls of fewer than kAmxMinRows rows (decode) go through the VNNI tiles, which stream the
// weights at memory bandwidth where a mostly empty 16-row tile gains nothing. C = acc - 128 *
// colsum, exact in int32. A call of m >= kAmxMinRows rows runs whole on the tiles (the padding
// rows' results are dropped), so each weight is read once per pair of row tiles.
// Features used: AMX-TILE, AMX-INT8 (through Tiles), AVX-512 F/BW/VL/VNNI.
#pragma once

#include <immintrin.h>

#include <cstring>

#include "cpumoe/qgemm.h"
#include "ukernels/common/x86/amx_gemm.h"
#include "ukernels/common/x86/avx512_common.h"
#include "ukernels/qgemm/qgemm_common.h"
#include "ukernels/qgemm/x86/qgemm_x86_vnni.h"

namespace cpumoe {
namespace {
namespace qgemm_amx {

constexpr int64_t kMr = 16;  // rows of one AMX tile; lhs offsets are taken at multiples of it
// K pads to 64 (the bytes of one A tile row), rows to 16; B as the VNNI kernel's.
using Packing = QGemmPacking<x86_vnni::kBlockCols, 64, 1, /*LhsRows=*/kMr, 1, 64>;
// Below this many rows a call goes to the VNNI tiles.
constexpr int64_t kAmxMinRows = 8;

inline void pack_lhs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  const int64_t kp = Packing::padded_k(k);
  x86_vnni::pack_lhs(m, k, kp, rows, packed);
  // The padding rows of the last tile: read by the tiles, their results dropped.
  std::memset(static_cast<uint8_t*>(packed) + m * kp, 0, size_t((round_up(m, kMr) - m) * kp));
}

inline void pack_rhs(int64_t n, int64_t k, const int8_t* rhs, int64_t stride, void* packed) {
  x86_vnni::pack_rhs(n, k, Packing::padded_k(k), rhs, stride, packed);
}

struct Ops {
  using Acc = int32_t;
  template <class Tiles, int C, int A, int B>
  static void dot() { Tiles::template dpbusd<C, A, B>(); }
  // The block's 16 values 128 * column sum follow its groups.
  static __m512i finish(const int32_t* row, const uint8_t* block_end) {
    return _mm512_sub_epi32(_mm512_load_si512(row), _mm512_loadu_si512(block_end));
  }
};

template <class Tiles>
void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  if (m <= 0 || n <= 0) return;
  const int64_t kp = Packing::padded_k(k);
  if (m < kAmxMinRows) {
    x86_vnni::run_f32(m, n, kp, lhs, rhs, dst, dst_stride, ep);
    return;
  }
  amx::run<Tiles, Ops>(m, n, kp, static_cast<const uint8_t*>(lhs),
                       static_cast<const uint8_t*>(rhs), x86_vnni::rhs_block_bytes(kp),
                       StoreF32{dst, dst_stride, &ep});
  if (ep.stream_dst) _mm_sfence();  // the non-temporal stores visible before the call returns
}

}  // namespace qgemm_amx
}  // namespace
}  // namespace cpumoe
