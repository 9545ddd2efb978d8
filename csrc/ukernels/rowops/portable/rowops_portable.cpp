// rowops_portable: the row operations built with the baseline flags, always compiled in: on
// AArch64 the NEON backend of rowops_vec.h (arm/rowops_neon.h), elsewhere the scalar
// definitions of quantize.h.
#include "cpumoe/rowops.h"
#include "ukernels/rowops/quantize.h"

#if defined(__aarch64__)
#include "ukernels/rowops/arm/rowops_neon.h"
#endif

namespace cpumoe {

#if defined(__aarch64__)
extern const RowOps rowops_portable =
    rowops_vec::make_rowops<rowops_vec::Neon>("rowops_portable", Isa::portable);
#else
namespace {

void to_bf16(const void* x, DType dt, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(load_as_f32(x, dt, i));
}

}  // namespace

extern const RowOps rowops_portable = {
    "rowops_portable",           Isa::portable,           rowops::quantize_row_scalar,
    rowops::activate_round_row, rowops::quantize_row_with_amax, rowops::activate_bf16_row,
    to_bf16,                     rowops::weighted_sum_pass,   rowops::group_sums,
    rowops::add_group_offsets,
};
#endif

}  // namespace cpumoe
