// q4gemm_qs8rs_q4ci16x8_8x16_avx512_vnni: the W4A8 GEMM (int8 activations x int4 / mxfp4 codes
// with group scales) on AVX-512 VNNI.
//
// vpdpbusd multiplies unsigned bytes by signed bytes. The weights are the unsigned side: a code
// decodes (vpshufb on a 16-byte table, the same instruction for both formats) to u = v + off,
// off = 8 for int4 (u in [0, 15]) and 12 for mxfp4 (u = 2 * E2M1 + 12 in [0, 24]); A stays signed.
// Then sum_g a * u = sum_g a * v + off * sum_g a, and the row sums of A per 32 k come with the
// packed A (`qs8rs`): each group's int32 accumulators start at -off * sum_g a (one broadcast per
// row and group) instead of 0, so the group's int32 sum is exact (vpdpbusd wraps, the true sum
// fits) with no extra instruction per weight vector. The other way (A shifted to u8, signed
// weights) would need the weights' sums per column and group: one more vpdpbusd per weight
// vector, i.e. twice the dot products at decode.
//
// Layouts:
//   A (`qs8rs`, Q4LhsRowSums): row i at i * (kp + kp / 8): kp = round_up(k, 32) int8, then kp / 32
//      int32 sums of 32-k slices.
//   B (`q4ci16x8`, Q4Packing<16> + NibbleSlices8<16>): blocks of 16 columns; per group, per 8 k,
//      64 bytes: byte 4c + t = column c's k 8s + t (low nibble) and 8s + 4 + t (high nibble); then
//      the group's 16 scales (fp32 for int4, E8M0 bytes for mxfp4, decoded here: the bytes read are
//      what the format is for).
// Loop: per column step (4 blocks = 64 columns for up to 3 rows, else 2 blocks) and row tile (up
// to 3 / 8 rows, rows split evenly), per group: per 8 k, each block's 64 bytes loaded and decoded
// into two zmm (and, shift + and, two vpshufb), then per row its two 4-byte A words broadcast and
// two vpdpbusd per block; at the group end, per row and block, cvt + mul by the group scales + add
// into the fp32 accumulator (the exact order of q4gemm.h: no FMA). The int32 accumulators stay in
// registers over the group; the fp32 ones, touched once per group, in L1 (so the register tile
// can be 8 rows). Decode (one row per expert) thus runs 4 independent weight streams with 5
// vector ops per 64 weight bytes besides the 2 vpdpbusd; software prefetch runs kPrefetch bytes
// ahead in each stream.
// Epilogue: * lhs_scale, + bias, masked tail stores (nothing past n is written).
// Features used: AVX-512 F, BW, VL, VNNI.
#if !defined(__x86_64__) || !defined(__AVX512F__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "q4gemm_qs8rs_q4ci16x8_8x16_avx512_vnni.cpp needs -mavx512f -mavx512bw -mavx512vl -mavx512vnni (set per file by CMake)"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpumoe/q4gemm.h"
#include "ukernels/common/x86/avx512_common.h"
#include "ukernels/q4gemm/x86/q4gemm_x86_common.h"

namespace cpumoe {
namespace {

constexpr int64_t kNr = 16;
using Packing = Q4Packing<kNr>;
using Arrange = NibbleSlices8<kNr>;
constexpr int64_t kSliceBytes = 4 * kNr;  // 8 k of one block
// Up to 3 rows: 4 blocks per step (4 weight streams, <= 12 int32 accumulators); more: 2 blocks,
// up to 8 rows (16 accumulators), so each decoded vector feeds up to 8 vpdpbusd. Besides them:
// 2 x NB decoded vectors, 2 broadcasts, the mask and the table.
constexpr int64_t kMr = 8;
constexpr int kSmallRows = 3, kSmallBlocks = 4, kRows = 8, kBlocks = 2;
constexpr int64_t kPrefetch = 1024;  // bytes ahead in each block's stream

// What stays in registers over the call: the nibble mask and the unsigned decode table.
struct Decode {
  __m512i mask, table;
  int32_t offset;
  explicit Decode(W4Format f) {
    const int8_t* t = w4_decode_table(f);
    offset = f == W4Format::mxfp4 ? 12 : 8;
    alignas(16) int8_t u[16];
    for (int c = 0; c < 16; ++c) u[c] = int8_t(t[c] + offset);
    mask = _mm512_set1_epi8(0x0f);
    table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(u)));
  }
  // 64 code bytes -> the unsigned values of k 0..3 (lo) and 4..7 (hi) of 16 columns.
  void operator()(const uint8_t* p, __m512i& lo, __m512i& hi) const {
    const __m512i x = _mm512_loadu_si512(p);
    lo = _mm512_shuffle_epi8(table, _mm512_and_si512(x, mask));
    hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(x, 4), mask));
  }
};

// The 16 fp32 scales of one group of a block (at p, after its codes).
template <bool Mx>
inline __m512 load_scales(const uint8_t* p) {
  if constexpr (!Mx) {
    return _mm512_loadu_ps(p);
  } else {
    // E8M0 e -> 2^(e - 128) as w4_mxfp4_scale: (e - 1) << 23, e = 0, 1 subnormal, 255 NaN.
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m512i bits = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    bits = _mm512_mask_sllv_epi32(bits, _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)),
                                  _mm512_set1_epi32(0x00200000), e);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)),
                                 _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(bits);
  }
}

inline __m512i bcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);  // folded into vpdpbusd's {1to16} memory operand
}

// The kernel as run_q4_f32 (q4gemm_x86_common.h) takes it: the walk's steps and the tile.
struct Kernel : Q4X86Steps<kNr, kSmallRows, kSmallBlocks, kRows, kBlocks, Decode> {
  template <int MR, int NB, bool Mx, int G>
  static void tile(const Q4Call<Decode>& c, int64_t i0, int64_t jb);
};

// Rows [i0, i0 + MR) of A x blocks [jb, jb + NB) of B (block b at bp + b * bstride).
// G: the group size when known at compile time (32: mxfp4's and the common int4 one, its slice
// loop and row sums unrolled), else 0 (w.group).
template <int MR, int NB, bool Mx, int G>
void Kernel::tile(const Q4Call<Decode>& c, int64_t i0, int64_t jb) {
  const uint8_t *a = c.a + i0 * c.lda, *bp = c.b + jb * c.bstride;
  const int64_t lda = c.lda, bstride = c.bstride, g = G > 0 ? G : c.w.group, groups = c.k / g;
  const int64_t gbytes = Packing::group_bytes(c.w), cbytes = Packing::codes_bytes(c.w);
  alignas(64) float acc[MR][NB][kNr] = {};
  __m512i isum[MR][NB];
  for (int64_t gi = 0; gi < groups; ++gi) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const uint32_t sum = uint32_t(Q4LhsRowSums::group_sum(a + r * lda, c.kp, gi, g));
      const __m512i init = _mm512_set1_epi32(int32_t(0u - uint32_t(c.dec.offset) * sum));
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) isum[r][b] = init;
    }
    const uint8_t* grp = bp + gi * gbytes;
    const int8_t* ag = reinterpret_cast<const int8_t*>(a) + gi * g;
    for (int64_t s = 0; s < g / 8; ++s) {
      // The slice of every block decoded first, then row by row: only one row's two broadcast
      // words are live at a time (with the rows inner, GCC keeps every row's broadcasts in
      // registers across the blocks and spills accumulators).
      __m512i lo[NB], hi[NB];
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        const uint8_t* p = grp + b * bstride + s * kSliceBytes;
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
        c.dec(p, lo[b], hi[b]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512i a0 = bcast(ag + r * lda + 8 * s), a1 = bcast(ag + r * lda + 8 * s + 4);
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) {
          isum[r][b] = _mm512_dpbusd_epi32(isum[r][b], lo[b], a0);
          isum[r][b] = _mm512_dpbusd_epi32(isum[r][b], hi[b], a1);
        }
      }
    }
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const __m512 sc = load_scales<Mx>(grp + b * bstride + cbytes);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r][b]), sc);
        _mm512_store_ps(acc[r][b], _mm512_add_ps(_mm512_load_ps(acc[r][b]), f));
      }
    }
  }
  const StoreF32Acc store{c.dst, c.ld, c.ep.bias, c.ep.stream_dst};
  for (int b = 0; b < NB; ++b) {
    const int64_t c0 = jb * kNr + kNr * b;
    const int64_t nc = std::min<int64_t>(kNr, c.n - c0);
    for (int r = 0; r < MR; ++r)
      store(i0 + r, c0, nc,
            _mm512_mul_ps(_mm512_load_ps(acc[r][b]), _mm512_set1_ps(c.ep.lhs_scale[i0 + r])));
  }
}

void run_f32(int64_t m, int64_t n, int64_t k, const W4Layout& w, const void* lhs,
             const void* rhs, float* dst, int64_t dst_stride, const Q4GemmEpilogue& ep) {
  run_q4_f32<Kernel>(m, n, k, w, lhs, rhs, dst, dst_stride, ep);
  if (ep.stream_dst) _mm_sfence();  // the non-temporal stores visible before the call returns
}

}  // namespace

extern const Q4GemmUkernel q4gemm_qs8rs_q4ci16x8_8x16_avx512_vnni =
    make_q4gemm<Q4LhsRowSums, Packing>("q4gemm_qs8rs_q4ci16x8_8x16_avx512_vnni",
                                       Isa::avx512_vnni, kMr, pack_lhs_qs8rs,
                                       pack_rhs_q4<Packing, Arrange>, run_f32);

}  // namespace cpumoe
