// bgemm_f32r_bf16ck8_4x8_portable: the bf16 GEMM for any CPU, in plain C++ with GCC/Clang vector
// extensions (4 x fp32 lanes: SSE2 on x86-64, NEON on AArch64; nothing beyond the baseline).
//
// A is packed as fp32 rows (bf16 widened once at packing: A is small and read once per column
// block, B is the big operand). B is packed in blocks of 8 output columns, k-major: the 8 bf16 of
// step k are contiguous (16 bytes), so a k step is one 16-byte load, two widenings (a shift into
// the high half of each fp32) and, per row, one broadcast and two multiply-adds into a 4 x 8 tile
// of fp32 accumulators (8 vector registers, within SSE2's 16). Sums run over k in order.
// Features used: none.
#include <algorithm>
#include <cstring>

#include "ukernels/bgemm/bgemm_common.h"

namespace cpumoe {
namespace {

// Kr = 4 keeps every packed B block a multiple of 64 bytes.
using Packing = BGemmPacking</*Nr=*/8, /*Kr=*/4, /*LhsBytes=*/4>;
constexpr int64_t kMr = 4;
constexpr int64_t kNr = Packing::kNr;

typedef float v4f __attribute__((vector_size(16)));
typedef uint32_t v4u __attribute__((vector_size(16)));

inline v4f widen(const uint16_t* p) {
  uint16_t h[4];
  std::memcpy(h, p, 8);
  const v4u u = {uint32_t(h[0]) << 16, uint32_t(h[1]) << 16, uint32_t(h[2]) << 16,
                 uint32_t(h[3]) << 16};
  v4f f;
  std::memcpy(&f, &u, 16);
  return f;
}

// Rows [0, MR) of one 8-column block: acc[r] = (cols 0-3, cols 4-7).
template <int MR>
inline void tile(const float* a, int64_t kp, const uint16_t* b, int64_t nc, float* dst,
                 int64_t ldd, const float* bias) {
  v4f lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = v4f{0, 0, 0, 0};
  for (int64_t x = 0; x < kp; ++x) {
    const v4f b0 = widen(b + x * kNr), b1 = widen(b + x * kNr + 4);
    for (int r = 0; r < MR; ++r) {
      const float av = a[r * kp + x];
      const v4f va = {av, av, av, av};
      lo[r] += va * b0;
      hi[r] += va * b1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    float v[kNr];
    std::memcpy(v, &lo[r], 16);
    std::memcpy(v + 4, &hi[r], 16);
    float* d = dst + r * ldd;
    if (bias != nullptr) {
      for (int64_t c = 0; c < nc; ++c) d[c] = v[c] + bias[c];
    } else {
      for (int64_t c = 0; c < nc; ++c) d[c] = v[c];
    }
  }
}

void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t ldd, const float* bias) {
  const int64_t kp = Packing::padded_k(k);
  const auto* a = static_cast<const float*>(lhs);
  const auto* b = static_cast<const uint16_t*>(rhs);
  for (int64_t j0 = 0; j0 < n; j0 += kNr) {
    const int64_t nc = std::min(kNr, n - j0);
    const uint16_t* bb = b + j0 * kp;
    const float* bs = bias ? bias + j0 : nullptr;
    int64_t i = 0;
    for (; i + kMr <= m; i += kMr) tile<4>(a + i * kp, kp, bb, nc, dst + i * ldd + j0, ldd, bs);
    switch (m - i) {
      case 3: tile<3>(a + i * kp, kp, bb, nc, dst + i * ldd + j0, ldd, bs); break;
      case 2: tile<2>(a + i * kp, kp, bb, nc, dst + i * ldd + j0, ldd, bs); break;
      case 1: tile<1>(a + i * kp, kp, bb, nc, dst + i * ldd + j0, ldd, bs); break;
      default: break;
    }
  }
}

}  // namespace

extern const BGemmUkernel bgemm_f32r_bf16ck8_4x8_portable = make_bgemm<Packing>(
    "bgemm_f32r_bf16ck8_4x8_portable", Isa::portable, kMr, pack_lhs_f32r<Packing>,
    pack_rhs_bf16c<Packing, 1>, run_f32);

}  // namespace cpumoe
