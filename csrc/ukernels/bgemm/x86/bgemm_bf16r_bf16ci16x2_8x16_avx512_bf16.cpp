// bgemm_bf16r_bf16ci16x2_8x16_avx512_bf16: the bf16 GEMM on AVX-512 BF16 (vdpbf16ps).
//
// vdpbf16ps multiplies 2 bf16 pairs per 32-bit lane and adds both products to the fp32 lane, 16
// lanes per zmm: c += a[2l] * b[2l] + a[2l+1] * b[2l+1]. With B's pair of column c in lane c and
// A's pair broadcast to all lanes, one instruction is 16 columns x 2 k.
//
// Layouts (kp = round_up(k, 2)):
//   A (`bf16r`): row i at i * kp bf16 (padding 0).
//   B (`bf16ci16x2`): block b of 16 output columns at b * 16 * kp bf16 (a multiple of 64 bytes):
//      kp / 2 groups of 64 bytes, group g holding column c's k = 2g, 2g+1 at bf16 2c, 2c+1 (one
//      zmm per group). Padding columns and padding k are zero.
// Register tile (the walk of gemm_tile.h, as the int8 VNNI kernel): up to 8 rows x 3 blocks (48
// columns, 24 zmm accumulators) or up to 6 rows x 4 blocks (64 columns), the whole K in
// registers: per 2 k, NB zmm loads of B and one 4-byte broadcast of A per row feed MR * NB
// vdpbf16ps. Decode (one row) runs 1 x 64 columns: four weight streams, each weight read once.
// Column tails are masked stores (nothing past n is written).
//
// Numerics: the hardware treats subnormal bf16 inputs and fp32 results as zero (DAZ/FTZ,
// whatever MXCSR says) and rounds to nearest even. Each product is exact in fp32 and the two of
// a pair are added to the accumulator one after the other, each addition rounded, the odd k
// first (Intel's pseudo-code; Zen 4 measured the same on random data): a plain k-term sum in the
// order 1, 0, 3, 2, ..., so within the usual bound, but it may differ in the last bits from the
// other kernels' k order.
// Features used: AVX-512 F, BW, VL, BF16.
#if !defined(__x86_64__) || !defined(__AVX512F__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VL__) || !defined(__AVX512BF16__)
#error "bgemm_bf16r_bf16ci16x2_8x16_avx512_bf16.cpp needs -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx512bf16 (set per file by CMake)"
#endif

#include <immintrin.h>

#include "ukernels/bgemm/bgemm_common.h"
#include "ukernels/common/gemm_tile.h"
#include "ukernels/common/x86/avx512_common.h"

namespace cpumoe {
namespace {

using Packing = BGemmPacking</*Nr=*/16, /*Kr=*/2, /*LhsBytes=*/2>;

// The arithmetic for gemm_tile.h: one group is 2 k, one vdpbf16ps of the broadcast A pair with a
// zmm of B (16 columns).
struct Ops : Avx512TileOperands {
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc dot(Acc c, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b);
  }
  static Acc finish(Acc c, const uint8_t*) { return c; }
};

}  // namespace

extern const BGemmUkernel bgemm_bf16r_bf16ci16x2_8x16_avx512_bf16 = make_bgemm<Packing>(
    "bgemm_bf16r_bf16ci16x2_8x16_avx512_bf16", Isa::avx512_bf16, /*mr=*/8,
    pack_lhs_bf16r<Packing>, pack_rhs_bf16c<Packing, 2>,
    run_f32_tiles<Ops, Packing, StoreF32Acc>);

}  // namespace cpumoe
