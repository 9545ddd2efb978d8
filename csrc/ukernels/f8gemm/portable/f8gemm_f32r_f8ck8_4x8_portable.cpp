// f8gemm_f32r_f8ck8_4x8_portable: the W8A16 FP8 GEMM for any CPU, in plain C++ with GCC/Clang
// vector extensions (4 x fp32 lanes: SSE2 on x86-64, NEON on AArch64; nothing beyond the
// baseline).
//
// A is packed as fp32 rows (bf16 widened once at packing, as in the bf16 portable kernel). B is
// packed in blocks of 8 columns (F8Packing), each group k-major: the 8 codes of one k step are
// contiguous. Per block, row chunk, group and piece of up to kKChunk k, the piece's codes are
// decoded once through the E4M3 table into fp32 in the call's scratch (kKChunk x 8 floats, in
// L1), then every 4-row tile runs over it as the bf16 kernel does: per k step two 4-lane loads,
// per row one broadcast and two multiplies and adds into a 4 x 8 tile of group sums (8 vector
// registers). 4-bit codes (W4A16, two per byte) are decoded through the layout's codebook
// instead. Each output's group sum runs over k in order from 0, whatever the call's offsets and
// extents, so sub-block calls give the whole call's bits. After a group, the sums are scaled
// into fp32 accumulators: acc = acc + S_g * s (no FMA: the build disables contraction).
// Features used: none.
#include <algorithm>
#include <cstring>

#include "ukernels/f8gemm/f8gemm_common.h"

namespace cpumoe {
namespace {

// Kr = 4: any Kr dividing 32 would do for this layout; 4 exercises the last group's padding.
using Packing = F8Packing</*Nr=*/8, /*Kr=*/4, /*LhsBytes=*/4, /*LhsRows=*/1, /*NibbleSpan=*/4>;
constexpr int64_t kMr = 4;
constexpr int64_t kNr = Packing::kNr;
constexpr int64_t kRowChunk = 64;  // group sums and accumulators of 64 rows x 8: 4 KB of stack
constexpr int64_t kKChunk = 256;   // decoded k steps per piece: 8 KB of fp32

typedef float v4f __attribute__((vector_size(16)));

inline v4f load4(const float* p) {
  v4f v;
  std::memcpy(&v, p, 16);
  return v;
}
inline void store4(float* p, v4f v) { std::memcpy(p, &v, 16); }

// sum[r][0..8) += A rows r < MR (at a + r * kp) . the kc decoded k steps at dec (8 floats each).
template <int MR>
inline void tile(const float* a, int64_t kp, const float* dec, int64_t kc, float (*sum)[kNr]) {
  v4f lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) {
    lo[r] = load4(sum[r]);
    hi[r] = load4(sum[r] + 4);
  }
  for (int64_t x = 0; x < kc; ++x) {
    const v4f b0 = load4(dec + x * kNr), b1 = load4(dec + x * kNr + 4);
    for (int r = 0; r < MR; ++r) {
      const float av = a[r * kp + x];
      const v4f va = {av, av, av, av};
      lo[r] += va * b0;
      hi[r] += va * b1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    store4(sum[r], lo[r]);
    store4(sum[r] + 4, hi[r]);
  }
}

// The decoded piece of the longest group: 0 for an empty call.
size_t scratch_bytes(int64_t m, int64_t n, int64_t k, const F8Layout& w) {
  if (m <= 0 || n <= 0 || k <= 0) return 0;
  const int64_t gp = Packing::padded_k(Packing::group_k(k, w));
  return size_t(kNr * std::min(kKChunk, gp)) * sizeof(float);
}

void run_f32(int64_t m, int64_t n, int64_t k, const F8Layout& w, const void* lhs, const void* rhs,
             float* dst, int64_t dst_stride, const F8GemmEpilogue& ep) {
  if (m <= 0 || n <= 0) return;
  const int64_t kp = Packing::padded_k(k), groups = f8_groups(k, w), gk = Packing::group_k(k, w);
  const int64_t gstride = Packing::group_stride(k, w);
  const float* table = kE4m3Table.v;
  const bool nibbles = w.code_bits == 4;
  float book[16];  // 4-bit codes: the codebook's values
  f8_codebook_values(w, 1.0f, book);
  const auto* a = static_cast<const float*>(lhs);
  const auto* b = static_cast<const uint8_t*>(rhs);
  float* const dec = static_cast<float*>(ep.scratch);
  for (int64_t j0 = 0; j0 < n; j0 += kNr) {
    const int64_t nc = std::min(kNr, n - j0);
    const uint8_t* blk = b + Packing::rhs_offset(j0, k, w);
    for (int64_t i0 = 0; i0 < m; i0 += kRowChunk) {
      const int64_t mc = std::min(kRowChunk, m - i0);
      float acc[kRowChunk][kNr] = {};
      float sum[kRowChunk][kNr];
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* grp = blk + g * gstride;
        const int64_t gp = Packing::padded_k(Packing::group_len(g, k, w));
        std::memset(sum, 0, sizeof(float) * size_t(mc * kNr));
        for (int64_t x0 = 0; x0 < gp; x0 += kKChunk) {
          const int64_t kc = std::min(kKChunk, gp - x0);
          if (nibbles) {  // a k step's 4 bytes: columns 0-3 low nibbles, 4-7 high
            const uint8_t* codes = grp + x0 * kNr / 2;
            for (int64_t t = 0; t < kc * kNr; t += 2 * 4)
              for (int64_t c = 0; c < 4; ++c) {
                const uint8_t byte = codes[t / 2 + c];
                dec[t + c] = book[byte & 15];
                dec[t + 4 + c] = book[byte >> 4];
              }
          } else {
            const uint8_t* codes = grp + x0 * kNr;
            for (int64_t t = 0; t < kc * kNr; ++t) dec[t] = table[codes[t]];
          }
          const float* ai = a + i0 * kp + g * gk + x0;
          int64_t i = 0;
          for (; i + kMr <= mc; i += kMr) tile<4>(ai + i * kp, kp, dec, kc, sum + i);
          switch (mc - i) {
            case 3: tile<3>(ai + i * kp, kp, dec, kc, sum + i); break;
            case 2: tile<2>(ai + i * kp, kp, dec, kc, sum + i); break;
            case 1: tile<1>(ai + i * kp, kp, dec, kc, sum + i); break;
            default: break;
          }
        }
        float s[kNr];
        std::memcpy(s, grp + Packing::codes_bytes(gp, w), sizeof(s));
        for (int64_t i = 0; i < mc; ++i)
          for (int64_t c = 0; c < kNr; ++c) acc[i][c] = acc[i][c] + sum[i][c] * s[c];
      }
      for (int64_t i = 0; i < mc; ++i)
        store_f8_row(dst + (i0 + i) * dst_stride + j0, acc[i], nc,
                     ep.bias != nullptr ? ep.bias + j0 : nullptr);
    }
  }
}

}  // namespace

extern const F8GemmUkernel f8gemm_f32r_f8ck8_4x8_portable = make_f8gemm<Packing>(
    "f8gemm_f32r_f8ck8_4x8_portable", Isa::portable, kMr, pack_lhs_f32r<Packing>,
    pack_rhs_f8<Packing, F8Interleaved<kNr, 1>>, run_f32, scratch_bytes);

}  // namespace cpumoe
