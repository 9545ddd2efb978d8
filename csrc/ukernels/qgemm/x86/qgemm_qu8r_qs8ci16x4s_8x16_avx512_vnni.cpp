// qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni: the int8 GEMM on AVX-512 VNNI (vpdpbusd).
//
// vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products to an int32 lane,
// 16 lanes per zmm. A is therefore shifted to unsigned at packing, u = a + 128, and the shift is
// taken back with column sums precomputed at prepack:
//   sum_k (a + 128) * b = sum_k a * b + 128 * sum_k b,  so  C = acc - 128 * colsum(B).
// Both sides are exact in int32 (vpdpbusd wraps, it does not saturate, and the true result fits),
// so the kernel is bit-exact for every int8 A and B.
//
// Layouts (kp = round_up(k, 4)):
//   A (`qu8r`): row i at i * kp, kp bytes of a + 128 (uint8); padding bytes are 128 (a = 0).
//   B (`qs8ci16x4s`): block b of 16 output columns at b * (16 * kp + 64): kp / 4 groups of 64
//      bytes, group g holding column c's k = 4g .. 4g+3 at bytes 4c .. 4c+3 (one zmm, one
//      vpdpbusd covers 16 columns x 4 k), then 16 int32: 128 * sum_k B[c][k]. Padding columns
//      and padding k are zero (so are their sums).
// Register tile (the walk of gemm_tile.h): up to 8 rows x 3 blocks (48 columns, 24 zmm
// accumulators) or up to 6 rows x 4 blocks (64 columns), the whole K in registers: per 4 k, NB
// zmm loads of B and one 4-byte broadcast of A per row feed MR * NB vpdpbusd. Small M (decode:
// one row per expert) runs 1 x 64 columns: four independent weight streams, read once, at memory
// bandwidth; the column tile of the call is walked in 64- or 48-column steps with the rows inner,
// so a step's weights stay in L1/L2 while the row tiles pass. Column tails are masked stores
// (nothing past n is written).
// The name's 8x16 is mr x nr (rows of the main tile x columns of one packed block).
// Features used: AVX-512 F, BW, VL, VNNI.
#if !defined(__x86_64__) || !defined(__AVX512F__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni.cpp needs -mavx512f -mavx512bw -mavx512vl -mavx512vnni (set per file by CMake)"
#endif

#include <immintrin.h>

#include <cstring>

#include "cpumoe/qgemm.h"
#include "ukernels/common/gemm_tile.h"
#include "ukernels/qgemm/qgemm_common.h"
#include "ukernels/common/x86/avx512_common.h"
#include "ukernels/qgemm/x86/qgemm_x86_vnni.h"

namespace cpumoe {
namespace x86_vnni {
namespace {

constexpr int64_t kNr = 16;

inline __mmask64 mask64(int64_t n) {
  return n >= 64 ? __mmask64(~0ULL) : __mmask64((1ULL << n) - 1);
}

// The arithmetic for gemm_tile.h: one group is 4 k, one vpdpbusd of the broadcast 4 A bytes with
// a zmm of B (16 columns); after the depth, the column sums behind the block are taken back.
struct Ops : Avx512TileOperands {
  using Acc = __m512i;
  static Acc zero() { return _mm512_setzero_si512(); }
  static Acc dot(Acc c, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(c, a, b); }
  static Acc finish(Acc c, const uint8_t* block_end) {
    return _mm512_sub_epi32(c, _mm512_loadu_si512(block_end));
  }
};
static_assert(Ops::kNr == kBlockCols, "one block is one zmm of int32 lanes");

template <class Store>
void run(int64_t m, int64_t n, int64_t kp, const void* lhs, const void* rhs, const Store& store) {
  gemm_tile::run<Ops>(m, n, static_cast<const uint8_t*>(lhs), kp, static_cast<const uint8_t*>(rhs),
                      rhs_block_bytes(kp), kp / 4, store);
}

}  // namespace

void pack_lhs(int64_t m, int64_t k, int64_t kp, const int8_t* const* rows, void* packed) {
  auto* dst = static_cast<uint8_t*>(packed);
  const __m512i shift = _mm512_set1_epi8(char(0x80));
  for (int64_t i = 0; i < m; ++i) {
    const int8_t* r = rows[i];
    uint8_t* d = dst + i * kp;
    for (int64_t x = 0; x < kp; x += 64) {
      // Lanes past k load as 0 and store as 128 (a = 0); lanes past kp are not stored.
      const __m512i v = _mm512_maskz_loadu_epi8(mask64(k - x), r + x);
      _mm512_mask_storeu_epi8(d + x, mask64(kp - x), _mm512_xor_si512(v, shift));
    }
  }
}

void pack_rhs(int64_t n, int64_t k, int64_t kp, const int8_t* rhs, int64_t stride, void* packed) {
  auto* dst = static_cast<int8_t*>(packed);
  const int64_t bstride = rhs_block_bytes(kp);
  gemm_tile::pack_rhs_groups<int8_t, 4>(n, k, kp, kNr, rhs, stride, dst, bstride);
  const int64_t blocks = (n + kNr - 1) / kNr;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    int32_t sums[kNr];
    for (int64_t c = 0; c < kNr; ++c) {
      const int64_t j = blk * kNr + c;
      int32_t s = 0;
      if (j < n)
        for (int64_t t = 0; t < k; ++t) s += rhs[j * stride + t];
      // 128 * s: |s| <= 128 * k, so this fits int32 for k < 2^17; wraps consistently beyond.
      sums[c] = int32_t(uint32_t(s) * 128u);
    }
    std::memcpy(dst + blk * bstride + 16 * kp, sums, sizeof(sums));
  }
}

void run_f32(int64_t m, int64_t n, int64_t kp, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  run(m, n, kp, lhs, rhs, StoreF32{dst, dst_stride, &ep});
  if (ep.stream_dst) _mm_sfence();  // the non-temporal stores visible before the call returns
}

}  // namespace x86_vnni

namespace {

constexpr int64_t kMr = 8;
// B blocks of 16 columns, each followed by its 16 int32 column sums (x86_vnni::rhs_block_bytes).
using Packing = QGemmPacking<x86_vnni::kBlockCols, 4, 1, 1, 1, 64>;

void pack_lhs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  x86_vnni::pack_lhs(m, k, Packing::padded_k(k), rows, packed);
}
void pack_rhs(int64_t n, int64_t k, const int8_t* rhs, int64_t stride, void* packed) {
  x86_vnni::pack_rhs(n, k, Packing::padded_k(k), rhs, stride, packed);
}
void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  x86_vnni::run_f32(m, n, Packing::padded_k(k), lhs, rhs, dst, dst_stride, ep);
}

}  // namespace

extern const QGemmUkernel qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni = make_qgemm<Packing>(
    "qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni", Isa::avx512_vnni, kMr, pack_lhs, pack_rhs, run_f32);

}  // namespace cpumoe
