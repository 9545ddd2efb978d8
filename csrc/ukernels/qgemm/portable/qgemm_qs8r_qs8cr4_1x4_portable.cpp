// qgemm_qs8r_qs8cr4_1x4_portable: the int8 GEMM for any CPU, in plain C++.
//
// A is packed as row-major rows of kp = round_up(k, 16) bytes, B as blocks of 4 output columns,
// each column a row of kp bytes. The inner loop is a straight int8*int8 -> int32 dot product over
// kp (a multiple of 16, no tail), four columns at a time, so the compiler vectorizes it at the
// baseline ISA (SSE2 on x86-64: widen + pmaddwd; NEON on AArch64: smull/sadalp) while the four
// B rows (4 * kp bytes) stay in L1 across all rows of A. Features used: none.
#include <algorithm>
#include <cstring>

#include "cpumoe/qgemm.h"
#include "ukernels/qgemm/qgemm_common.h"

namespace cpumoe {
namespace {

constexpr int64_t kMr = 1;
using Packing = QGemmPacking<4, 16>;
constexpr int64_t kNr = Packing::kNr;

void pack_rhs(int64_t n, int64_t k, const int8_t* rhs, int64_t stride, void* packed) {
  const int64_t kp = Packing::padded_k(k);
  auto* dst = static_cast<int8_t*>(packed);
  const int64_t np = round_up(n, kNr);
  for (int64_t j = 0; j < np; ++j) {
    if (j < n) {
      std::memcpy(dst + j * kp, rhs + j * stride, size_t(k));
      std::memset(dst + j * kp + k, 0, size_t(kp - k));
    } else {
      std::memset(dst + j * kp, 0, size_t(kp));
    }
  }
}

// Four dot products of one A row with four B columns. Separate accumulators per column keep the
// reductions independent so the vectorizer handles each as a plain sum.
inline void dot4(const int8_t* __restrict a, const int8_t* __restrict b, int64_t kp,
                 int32_t out[4]) {
  const int8_t* b0 = b;
  const int8_t* b1 = b + kp;
  const int8_t* b2 = b + 2 * kp;
  const int8_t* b3 = b + 3 * kp;
  int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int64_t x = 0; x < kp; ++x) {
    const int32_t av = a[x];
    s0 += av * b0[x];
    s1 += av * b1[x];
    s2 += av * b2[x];
    s3 += av * b3[x];
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

template <class Store>
void run(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, const Store& store) {
  const int64_t kp = Packing::padded_k(k);
  const auto* a = static_cast<const int8_t*>(lhs);
  const auto* b = static_cast<const int8_t*>(rhs);
  for (int64_t j0 = 0; j0 < n; j0 += kNr) {
    const int64_t nc = std::min(kNr, n - j0);
    for (int64_t i = 0; i < m; ++i) {
      int32_t acc[kNr];
      dot4(a + i * kp, b + j0 * kp, kp, acc);
      store(i, j0, nc, acc);
    }
  }
}

void run_f32(int64_t m, int64_t n, int64_t k, const void* lhs, const void* rhs, float* dst,
             int64_t dst_stride, const QGemmEpilogue& ep) {
  run(m, n, k, lhs, rhs, [&](int64_t i, int64_t j0, int64_t nc, const int32_t* acc) {
    store_f32_row(dst + i * dst_stride + j0, acc, nc, ep.lhs_scale[i], ep.rhs_scale + j0,
                  ep.bias ? ep.bias + j0 : nullptr);
  });
}

}  // namespace

extern const QGemmUkernel qgemm_qs8r_qs8cr4_1x4_portable = make_qgemm<Packing>(
    "qgemm_qs8r_qs8cr4_1x4_portable", Isa::portable, kMr, pack_lhs_qs8r<Packing>, pack_rhs, run_f32);

}  // namespace cpumoe
