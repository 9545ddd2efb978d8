// rowops_portable: the row operations of cpumoe/quantize.h behind the RowOps interface, built
// with the baseline flags (scalar on x86-64, baseline NEON on AArch64). Always compiled in.
#include "cpumoe/quantize.h"
#include "cpumoe/rowops.h"

namespace cpumoe {
namespace {

float quantize(const void* x, DType dt, int64_t n, int8_t* q) {
  return rowops::quantize_row(x, dt, n, q);
}

void to_bf16(const void* x, DType dt, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(load_as_f32(x, dt, i));
}

}  // namespace

extern const RowOps rowops_portable = {
    "rowops_portable",           Isa::portable,           quantize,
    rowops::activate_round_row, rowops::quantize_row_with_amax, rowops::activate_bf16_row,
    to_bf16,                     rowops::weighted_sum_pass,
};

}  // namespace cpumoe
