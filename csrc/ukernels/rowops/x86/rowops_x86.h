// The parts of the rowops_vec.h backend that AVX2 and AVX-512 write the same way, over the
// instruction wrappers of each file's own struct (Ops): X86<Ops> is the backend.
#pragma once

#include <cstdint>
#include <cstring>

#include "ukernels/rowops/rowops_vec.h"

namespace cpumoe {
namespace {
namespace rowops_vec {

template <class Ops>
struct X86 : Ops {
  using typename Ops::V;
  using typename Ops::VI;
  using VA = VI;  // the absolute maximum as the unsigned max of |x| bits
  static constexpr bool kMaskedTails = true;
  static constexpr bool kBf16Cvt = false;
  static constexpr int64_t kAmaxUnroll = 2;

  static CPUMOE_ROWOPS_INLINE V neg(V x) {
    return Ops::from_bits(Ops::xor_(Ops::bits(x), Ops::seti(int32_t(0x80000000u))));
  }
  static CPUMOE_ROWOPS_INLINE V abs(V x) {
    return Ops::from_bits(Ops::and_(Ops::bits(x), Ops::seti(0x7fffffff)));
  }
  static CPUMOE_ROWOPS_INLINE V rint(V v) {
    const V magic = Ops::splat(12582912.0f);
    return Ops::sub(Ops::add(v, magic), magic);
  }
  // int(n), NaN -> 0 as the scalar's guarded cast (n is integral and |n| <= 127 otherwise).
  static CPUMOE_ROWOPS_INLINE V pow2i(V n) {
    return Ops::from_bits(Ops::template slli<23>(Ops::addi(Ops::cvtt_or_zero(n), Ops::seti(127))));
  }

  static CPUMOE_ROWOPS_INLINE VA amax_zero() { return Ops::seti(0); }
  static CPUMOE_ROWOPS_INLINE VA amax_acc(VA m, V v) { return Ops::max_u32(m, Ops::bits(abs(v))); }
  static CPUMOE_ROWOPS_INLINE VA amax_merge(VA a, VA b) { return Ops::max_u32(a, b); }
  // Exact unless a NaN is among the lanes (then *nan: the caller takes the scalar rule).
  static CPUMOE_ROWOPS_INLINE float reduce_amax(VA m, bool* nan) {
    const uint32_t b = Ops::reduce_max_u32(m);
    *nan = b > 0x7f800000u;
    float a;
    std::memcpy(&a, &b, 4);
    return a;
  }
};

}  // namespace rowops_vec
}  // namespace
}  // namespace cpumoe
