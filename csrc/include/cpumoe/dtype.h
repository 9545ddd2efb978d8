/// @file dtype.h
/// Element types of activations and biases, and bit-exact conversions between fp32, fp16 and bf16.
///
/// The conversions are plain C++ (no F16C, no FEAT_FP16 needed) so that they work on every CPU and
/// vectorize as straight-line integer code. Rounding is round-to-nearest-even, as torch and numpy do.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace cpumoe {

/// Floating-point element type of hidden states, outputs and (optionally) biases.
enum class DType : int { f32 = 0, f16 = 1, bf16 = 2 };

/// Size in bytes of one element of @p dt.
inline constexpr int64_t dtype_size(DType dt) { return dt == DType::f32 ? 4 : 2; }

/// Lower-case name ("float32", "float16", "bfloat16") as torch and numpy spell it.
inline const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
  }
  return "?";
}

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// bf16 (upper half of an fp32) to fp32: exact.
inline float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }

/// fp32 to bf16, round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

/// IEEE binary16 to fp32: exact, subnormals included.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp != 0) return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return f32_from_bits(sign);
  // Subnormal: value = mant * 2^-24, exact in fp32.
  const float v = float(mant) * 5.9604644775390625e-08f;
  return f32_from_bits(sign | f32_bits(v));
}

/// fp32 to IEEE binary16, round to nearest even, overflow to inf, NaN stays NaN.
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);          // nan
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);         // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                                         // below 2^-14: subnormal or 0
    // Adding 0.5 (2^-1) aligns the mantissa so that fp32 rounding does the fp16 rounding.
    const float r = f32_from_bits(abs) + 0.5f;
    return uint16_t(sign | (f32_bits(r) - 0x3f000000u));
  }
  uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u);  // round to nearest even at bit 13
  return uint16_t(sign | ((m - 0x38000000u) >> 13));
}

/// f(std::integral_constant<DType, dt>{}): a run-time dtype to a compile-time one, for code
/// templated over the dtype.
template <class F>
inline decltype(auto) with_dtype(DType dt, const F& f) {
  switch (dt) {
    case DType::f16: return f(std::integral_constant<DType, DType::f16>{});
    case DType::bf16: return f(std::integral_constant<DType, DType::bf16>{});
    case DType::f32: break;
  }
  return f(std::integral_constant<DType, DType::f32>{});
}

/// Load element @p i of a buffer of type @p dt as fp32.
inline float load_as_f32(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.f;
}

/// Round @p v to the precision of @p dt and back to fp32 (identity for f32).
inline float round_to_dtype(float v, DType dt) {
  switch (dt) {
    case DType::f32: return v;
    case DType::f16: return f16_to_f32(f32_to_f16(v));
    case DType::bf16: return bf16_to_f32(f32_to_bf16(v));
  }
  return v;
}

}  // namespace cpumoe
