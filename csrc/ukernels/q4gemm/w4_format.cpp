// The 4-bit weight formats of q4gemm.h: their code tables (the names are the format table's,
// weight_format.h). Built without ISA flags.
#include "cpumoe/q4gemm.h"

namespace cpumoe {

namespace {
// int4: the code is a two's-complement nibble.
constexpr int8_t kInt4[16] = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};
// mxfp4: 2 * E2M1, E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0-7, bit 3 the sign.
constexpr int8_t kMxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
}  // namespace

const int8_t* w4_decode_table(W4Format f) {
  switch (f) {
    case W4Format::int4: return kInt4;
    case W4Format::mxfp4: return kMxfp4;
    case W4Format::int4_affine:  // packed as int4 (W4Plan)
    case W4Format::int8_affine: return nullptr;  // int4 planes, or 8-bit codes c - 128
  }
  return nullptr;
}

}  // namespace cpumoe
