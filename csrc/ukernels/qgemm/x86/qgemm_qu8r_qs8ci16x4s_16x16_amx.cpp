// qgemm_qu8r_qs8ci16x4s_16x16_amx: the int8 GEMM on AMX-INT8 tiles (Sapphire Rapids and later),
// with the AVX-512 VNNI kernel's packing, so the rows AMX does not take run through that kernel.
//
// tdpbusd multiplies a 16 x 64 tile of unsigned bytes (16 rows of A, 64 k) by a 16 x 64 tile of
// signed bytes (16 groups of 4 k, each 16 columns x 4 bytes) into a 16 x 16 int32 tile. Those are
// exactly the `qu8r` / `qs8ci16x4s` layouts of qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni with the
// depth padded to kp = round_up(k, 64): an A tile is 16 packed rows at stride kp, a B tile is 16
// consecutive 64-byte groups of one column block (stride 64). tdpbusd (u8 x s8) rather than
// tdpbssd: with the shifted A and the column sums both kernels share one packing, and the small-M
// rows (decode, and the m % 16 rows left over) go through the VNNI tile code, which streams the
// weights at memory bandwidth where AMX gains nothing. C = acc - 128 * colsum, exact in int32.
//
// Register tile: 2 x 2 AMX tiles (32 rows x 32 columns, tmm0-3 accumulators, tmm4-5 A, tmm6-7 B)
// over the whole K; 1 x 2, 2 x 1, 1 x 1 at the edges. The accumulators go through a 4 KB buffer
// on the stack to the AVX-512 epilogue (sums taken back, scales, bias, masked tail stores).
// Tiles are configured once per call (ldtilecfg) and released at its end.
// Features used: AMX-TILE, AMX-INT8, AVX-512 F/BW/VL/VNNI. The OS permission for the tile data
// (arch_prctl ARCH_REQ_XCOMP_PERM) is part of cpu_supports(Isa::amx).
#if !defined(__x86_64__) || !defined(__AMX_TILE__) || !defined(__AMX_INT8__) || \
    !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || \
    !defined(__AVX512VNNI__)
#error "qgemm_qu8r_qs8ci16x4s_16x16_amx.cpp needs -mamx-tile -mamx-int8 and the AVX-512 VNNI flags (set per file by CMake)"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpumoe/qgemm.h"
#include "ukernels/common/x86/avx512_common.h"
#include "ukernels/qgemm/qgemm_common.h"
#include "ukernels/qgemm/x86/qgemm_x86_vnni.h"

namespace cpumoe {
namespace {

constexpr int64_t kMr = 16;  // rows of one AMX tile; lhs offsets are taken at multiples of it
// K pads to 64, the bytes of one A tile row; B as the VNNI kernel's (x86_vnni::rhs_block_bytes).
using Packing = QGemmPacking<x86_vnni::kBlockCols, 64, 1, 1, 1, 64>;
constexpr int64_t kNr = Packing::kNr;

void pack_lhs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  x86_vnni::pack_lhs(m, k, Packing::padded_k(k), rows, packed);
}
void pack_rhs(int64_t n, int64_t k, const int8_t* rhs, int64_t stride, void* packed) {
  x86_vnni::pack_rhs(n, k, Packing::padded_k(k), rhs, stride, packed);
}

// The ldtilecfg operand (palette 1): tiles 0-7 all 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

struct TileScope {
  TileScope() {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// RT row tiles (16 rows each) x CT column blocks, the whole depth; tile indices are immediates.
template <int RT, int CT, class Store>
void amx_tile(int64_t i0, int64_t j0, int64_t n, const uint8_t* a, int64_t kp, const int8_t* b,
              int64_t bstride, const Store& store) {
  _tile_zero(0);
  if constexpr (CT > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && CT > 1) _tile_zero(3);
  for (int64_t k0 = 0; k0 < kp; k0 += 64) {
    _tile_loadd(4, a + k0, kp);
    _tile_loadd(6, b + 16 * k0, 64);
    if constexpr (CT > 1) _tile_loadd(7, b + bstride + 16 * k0, 64);
    _tile_dpbusd(0, 4, 6);
    if constexpr (CT > 1) _tile_dpbusd(1, 4, 7);
    if constexpr (RT > 1) {
      _tile_loadd(5, a + 16 * kp + k0, kp);
      _tile_dpbusd(2, 5, 6);
      if constexpr (CT > 1) _tile_dpbusd(3, 5, 7);
    }
  }
  alignas(64) int32_t buf[4][16][16];
  _tile_stored(0, buf[0], 64);
  if constexpr (CT > 1) _tile_stored(1, buf[1], 64);
  if constexpr (RT > 1) _tile_stored(2, buf[2], 64);
  if constexpr (RT > 1 && CT > 1) _tile_stored(3, buf[3], 64);
  for (int c = 0; c < CT; ++c) {
    const __m512i sums = _mm512_loadu_si512(b + c * bstride + 16 * kp);
    const int64_t c0 = j0 + 16 * c;
    const int64_t nc = std::min<int64_t>(16, n - c0);
    for (int r = 0; r < RT; ++r)
      for (int i = 0; i < 16; ++i)
        store(i0 + 16 * r + i, c0, nc, _mm512_sub_epi32(_mm512_load_si512(buf[2 * r + c][i]), sums));
  }
}

// The rows [0, m16) (a multiple of 16) on AMX.
template <class Store>
void run_amx(int64_t m16, int64_t n, int64_t kp, const uint8_t* a, const int8_t* b, const Store& store) {
  const TileScope tiles;
  const int64_t bstride = x86_vnni::rhs_block_bytes(kp);
  const int64_t blocks = (n + kNr - 1) / kNr;
  // Column pairs outer: their weights (2 x 16 x kp bytes) stay in L1/L2 while the row tiles pass.
  for (int64_t jb = 0; jb < blocks; jb += 2) {
    const bool two_cols = jb + 1 < blocks;
    const int8_t* bj = b + jb * bstride;
    for (int64_t i0 = 0; i0 < m16; i0 += 32) {
      const bool two_rows = i0 + 16 < m16;
      const uint8_t* ai = a + i0 * kp;
      if (two_rows && two_cols) amx_tile<2, 2>(i0, jb * kNr, n, ai, kp, bj, bstride, store);
      else if (two_rows) amx_tile<2, 1>(i0, jb * kNr, n, ai, kp, bj, bstride, store);
      else if (two_cols) amx_tile<1, 2>(i0, jb * kNr, n, ai, kp, bj, bstride, store);
      else amx_tile<1, 1>(i0, jb * kNr, n, ai, kp, bj, bstride, store);
    }
  }
}

// Fewer rows than this go to the VNNI tiles entirely: AMX only pays off from a full tile.
constexpr int64_t kAmxMinRows = 16;

void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  if (m <= 0 || n <= 0) return;
  const int64_t kp = Packing::padded_k(k);
  const int64_t m16 = m >= kAmxMinRows ? m / 16 * 16 : 0;
  const auto* a = static_cast<const uint8_t*>(lhs);
  if (m16 > 0)
    run_amx(m16, n, kp, a, static_cast<const int8_t*>(rhs), StoreF32{dst, dst_stride, &ep});
  if (m16 < m) {
    const QGemmEpilogue rest{ep.lhs_scale + m16, ep.rhs_scale, ep.bias};
    x86_vnni::run_f32(m - m16, n, kp, a + m16 * kp, rhs, dst + m16 * dst_stride, dst_stride, rest);
  }
}

}  // namespace

extern const QGemmUkernel qgemm_qu8r_qs8ci16x4s_16x16_amx = make_qgemm<Packing>(
    "qgemm_qu8r_qs8ci16x4s_16x16_amx", Isa::amx, kMr, pack_lhs, pack_rhs, run_f32);

}  // namespace cpumoe
