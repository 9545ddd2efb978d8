/// @file q4gemm.h
/// The W4A8 GEMM microkernel family: int8 activations x 4-bit weights with one scale per group of
/// `group` consecutive k, -> fp32. One interface struct that every ISA variant fills in, and the
/// registry that lists the variants best first.
///
/// A weight is a 4-bit code c (0..15) that decodes to an int8 value v = w4_decode_table(fmt)[c]
/// (or, for W4Format::int8_affine on kernels with Q4GemmUkernel::codes8, an 8-bit code c (0..255)
/// with v = c - 128 and a fp32 group scale as int4's; its mins are the pipeline's, W4Plan):
///   - W4Format::int4:  v = c as a two's-complement nibble, in [-8, 7]; the group scale is a
///     positive fp32 value s; w = v * s.
///   - W4Format::mxfp4: v = 2 * E2M1(c) in {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12} (nibble: sign
///     bit 3, exponent bits 2-1, mantissa bit 0); the group (32 k) scale is an E8M0 byte e with
///     fp32 value w4_mxfp4_scale(e) = 2^(e - 128) (the 1/2 of the doubled values folded in;
///     e = 255 is NaN); w = v * that.
///
/// A kernel computes, for row i (quantized activations, rows gathered per expert) and output
/// column j of B (one expert's weight matrix [N][K]):
///   isum_g = sum_{k in group g} A[i][k] * v[j][k]            (exact int32)
///   acc    = ((0 + float(isum_0) * s[j][0]) + float(isum_1) * s[j][1]) + ...
///            (fp32, g increasing, each product and sum rounded: no FMA)
///   dst    = acc * lhs_scale[i] + bias[j]                     (fp32, in that order)
/// With activations quantized per group (Q4GemmEpilogue::lhs_group_scale, a scale a[i][g] per
/// row and weight group), each term is (float(isum_g) * s[j][g]) * a[i][g] instead.
/// so every kernel gives the same bits as the naive oracle.
///
/// Kernel names: q4gemm_<lhs>_<rhs>_<mr>x<nr>_<isa> (csrc/ukernels/README.md); the lhs layouts are
/// those of the qgemm family.
///
/// Sizes: k is a multiple of the group, the group a multiple of kW4GroupMultiple (so kernels never
/// pad K); m >= 0, n >= 0 need no padding by the caller (packing pads n up to nr).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpumoe/cpu_features.h"
#include "cpumoe/weight_format.h"

namespace cpumoe {

/// The 4-bit weight formats: the q4gemm rows of the format table (weight_format.h), with the
/// same values as their WeightFormat enumerators.
/// The kernels decode int4 and mxfp4, and those with Q4GemmUkernel::codes8 int8_affine's 8-bit
/// codes; int4_affine layers are packed as int4, int8_affine layers for the other kernels as two
/// int4 planes (W4Plan).
enum class W4Format : int32_t {
  int4 = int32_t(WeightFormat::int4),
  mxfp4 = int32_t(WeightFormat::mxfp4),
  int4_affine = int32_t(WeightFormat::int4_affine),
  int8_affine = int32_t(WeightFormat::int8_affine),
};
static_assert(weight_format_info(WeightFormat::int4).family == KernelFamily::q4gemm &&
                  weight_format_info(WeightFormat::mxfp4).family == KernelFamily::q4gemm &&
                  weight_format_info(WeightFormat::int4_affine).family == KernelFamily::q4gemm &&
                  weight_format_info(WeightFormat::int8_affine).family == KernelFamily::q4gemm,
              "a W4Format is a q4gemm row of the format table");

/// Whether a layer of format @p f has (scale, min) pairs: its mins become the pipeline's group
/// offsets (W4Plan::offset).
[[gnu::always_inline]] constexpr bool w4_affine(W4Format f) {
  return f == W4Format::int4_affine || f == W4Format::int8_affine;
}

/// Plane scale and min of an affine group (W4Plan::pair).
struct W4PlanePair {
  float scale, min;
};

/// How a layer of format `format` is packed for a kernel: the format the kernel decodes, and in
/// how many planes.
///   - int4, mxfp4: as they are, one plane.
///   - int4_affine: codes c as the int4 values c - 8, one plane; scale * c + min = scale * (c - 8)
///     + offset with offset = min + 8 * scale (one fp32 rounding; 8 * scale is exact).
///   - int8_affine, kernel with codes8: the 8-bit codes c as they are (the kernel's value c - 128),
///     one plane; offset = min + 128 * scale.
///   - int8_affine, other kernels: two int4_affine planes, code = 16 hi + lo: hi with (16 scale,
///     min) (offset min + 128 scale, 16 scale exact), lo with (scale, 0) (offset 8 scale), the lo
///     plane's result added to the hi plane's in fp32.
struct W4Plan {
  W4Format format;  ///< the layer's
  W4Format kernel;  ///< what the kernel decodes (W4Layout::format)
  int planes;       ///< 1, or 2 (int8_affine without codes8)
  /// Plane @p plane's 4-bit (or, for kernel int8_affine, 8-bit) code of the layer's code @p c,
  /// as pack_rhs takes it.
  [[gnu::always_inline]] uint8_t code(int plane, uint8_t c) const {
    if (kernel == W4Format::int8_affine || !w4_affine(format)) return c;
    const uint8_t nib = planes == 1 ? c : plane == 0 ? uint8_t(c >> 4) : uint8_t(c & 15);
    return uint8_t(nib ^ 8);  // the int4 value nib - 8, as a nibble
  }
  /// Plane @p plane's (scale, min) of a group whose pair is (@p scale, @p min).
  [[gnu::always_inline]] W4PlanePair pair(int plane, float scale, float min) const {
    if (planes == 1) return {scale, min};
    return plane == 0 ? W4PlanePair{16.0f * scale, min} : W4PlanePair{scale, 0.0f};
  }
  /// Plane @p plane's group offset of the pair (@p scale, @p min): the term the mins add once
  /// the kernel runs the codes as signed values (above).
  [[gnu::always_inline]] float offset(int plane, float scale, float min) const {
    const W4PlanePair p = pair(plane, scale, min);
    return p.min + (kernel == W4Format::int8_affine ? 128.0f : 8.0f) * p.scale;
  }
};

/// The plan of a layer of format @p f for a kernel that decodes 8-bit codes or not (@p codes8).
[[gnu::always_inline]] constexpr W4Plan w4_plan(W4Format f, bool codes8) {
  if (f == W4Format::int8_affine)
    return codes8 ? W4Plan{f, f, 1} : W4Plan{f, W4Format::int4, 2};
  return W4Plan{f, w4_affine(f) ? W4Format::int4 : f, 1};
}

/// The format-table enumerator of @p f.
[[gnu::always_inline]] constexpr WeightFormat weight_format_of(W4Format f) {
  return WeightFormat(int32_t(f));
}
/// The W4Format of @p f into @p out; false when @p f is not a q4gemm format.
constexpr bool w4_format_of(WeightFormat f, W4Format* out) {
  if (weight_format_info(f).format != f || weight_format_info(f).family != KernelFamily::q4gemm)
    return false;
  *out = W4Format(int32_t(f));
  return true;
}

/// "int4" / "mxfp4": the table's name.
constexpr const char* w4_format_name(W4Format f) {
  return weight_format_name(weight_format_of(f));
}

/// The int8 values of the 16 codes of format @p f (see the file comment); nullptr for a value
/// without a table.
const int8_t* w4_decode_table(W4Format f);

/// The fp32 scale of an mxfp4 group whose E8M0 byte is @p e: 2^(e - 128), NaN for e = 255
/// (exact: 2^-128 at e = 0 is a subnormal fp32).
inline float w4_mxfp4_scale(uint8_t e) {
  uint32_t bits;
  if (e == 255) bits = 0x7fc00000u;           // NaN
  else if (e >= 2) bits = uint32_t(e - 1) << 23;  // 2^((e - 1) - 127)
  else bits = e == 1 ? 0x00400000u : 0x00200000u;  // 2^-127, 2^-128 (subnormal)
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

/// How one packed weight matrix is laid out beyond its kernel: the format and the group size.
struct W4Layout {
  W4Format format = W4Format::int4;
  int64_t group = 32;  ///< a multiple of kW4GroupMultiple; exactly 32 for mxfp4
  /// Bytes of one group scale in the input of pack_rhs: 1 for mxfp4's E8M0, else 4 (fp32: the
  /// affine formats' mins are not the kernel's).
  [[gnu::always_inline]] constexpr int64_t scale_bytes() const {
    return format == W4Format::mxfp4 ? 1 : 4;
  }
  /// Bits of one packed code: 8 for int8_affine (Q4GemmUkernel::codes8), else 4.
  [[gnu::always_inline]] constexpr int64_t code_bits() const {
    return format == W4Format::int8_affine ? 8 : 4;
  }
};

/// The epilogue of Q4GemmUkernel::run_f32 (the weight scales live in the packed B) and the
/// call's scratch.
struct Q4GemmEpilogue {
  const float* lhs_scale;  ///< [m]: per-row (per-token) scale, from the first row of the call
  const float* bias;       ///< [n] or nullptr, from the first column of the call
  /// dst is large and not read again soon (QGemmEpilogue::stream_dst); same values either way.
  bool stream_dst = false;
  /// Q4GemmUkernel::scratch_bytes(m, n, k, w) bytes, 64-byte aligned, that the call may
  /// overwrite (contents in and out undefined); may be nullptr when that is 0. The caller owns
  /// it: kernels never allocate.
  void* scratch = nullptr;
  /// nullptr, or [m][k / group] (row stride k / group, from the first row of the call): the
  /// activations' scale per row and weight group, multiplied into each group's term (file
  /// comment); lhs_scale still applies after the sum (1.0 when these carry the whole scale).
  const float* lhs_group_scale = nullptr;
};

/// One microkernel variant. Sizes in elements; pointers non-null where their size is non-zero.
/// Packed buffers are 64-byte aligned by the callers; kernels use unaligned loads.
struct Q4GemmUkernel {
  const char* name;  ///< the kernel's name in the grammar above
  Isa isa;           ///< the ISA level it needs at run time
  int64_t mr;        ///< rows of the main register tile; lhs offsets are taken at multiples of it
  int64_t nr;        ///< columns of a packed B block; rhs offsets are taken at multiples of it
  int64_t kr;        ///< divides kW4GroupMultiple (K is never padded)
  /// Runs W4Layout::format int8_affine (8-bit codes, value c - 128: the file comment); the
  /// others get int8_affine layers as two int4 planes (W4Plan).
  bool codes8;

  /// Bytes of packed A for @p m rows of depth @p k.
  size_t (*lhs_packed_size)(int64_t m, int64_t k);
  /// Byte offset of row @p m_idx (a multiple of mr) in packed A of depth @p k.
  size_t (*lhs_packed_offset)(int64_t m_idx, int64_t k);
  /// Packs @p m int8 rows of depth @p k (row i from rows[i][0..k)); row pieces at multiples of mr
  /// write what one call writes there (QGemmUkernel::pack_lhs).
  void (*pack_lhs)(int64_t m, int64_t k, const int8_t* const* rows, void* lhs_packed);

  /// Bytes of packed B (codes and scales) for @p n output columns of depth @p k.
  size_t (*rhs_packed_size)(int64_t n, int64_t k, const W4Layout& w);
  /// Byte offset of output column @p n_idx (a multiple of nr) in packed B.
  size_t (*rhs_packed_offset)(int64_t n_idx, int64_t k, const W4Layout& w);
  /// Bytes of scratch one pack_rhs call of this shape needs, 0 when it needs none. PackedExperts
  /// reserves it before its parallel loop, one block per thread, at the largest over a layer's
  /// w13 and w2 shapes.
  size_t (*pack_scratch_bytes)(int64_t n, int64_t k, const W4Layout& w);
  /// Packs B: column j's codes (one per byte, its low 4 bits: the high ones are ignored, so int4
  /// values given as two's-complement int8 are their own codes; int8_affine: all 8 bits) at
  /// codes + j * code_stride, its k / group scales at scales + j * scale_stride *
  /// w.scale_bytes() bytes (fp32 for int4 and int8_affine, E8M0 bytes for mxfp4). Every column's
  /// codes and scales are read, nothing else.
  /// @pre w.format is int4 or mxfp4, or int8_affine with codes8.
  /// @pre @p scratch holds pack_scratch_bytes(n, k, w) bytes, 64-byte aligned, used by no other
  ///      call at the same time (contents in and out undefined; may be nullptr when that is 0).
  ///      The caller owns it: kernels never allocate.
  void (*pack_rhs)(int64_t n, int64_t k, const W4Layout& w, const uint8_t* codes,
                   int64_t code_stride, const void* scales, int64_t scale_stride,
                   void* rhs_packed, void* scratch);

  /// Bytes of scratch one run_f32 call of this shape needs (Q4GemmEpilogue::scratch), 0 for
  /// kernels that need none. Non-decreasing in @p m and @p n, so a caller reserves it once at
  /// the largest shape it will call (the MoE planner: a task's rows and columns, k = H or I).
  size_t (*scratch_bytes)(int64_t m, int64_t n, int64_t k, const W4Layout& w);

  /// dst[i * dst_stride + j] for i < m, j < n as in the file comment; nothing else of dst is
  /// written. @p lhs_packed / @p rhs_packed point at row 0 / column 0 of the call.
  /// @pre k % w.group == 0; ep.scratch holds scratch_bytes(m, n, k, w) bytes, 64-byte aligned,
  ///      used by no other call at the same time.
  void (*run_f32)(int64_t m, int64_t n, int64_t k, const W4Layout& w, const void* lhs_packed,
                  const void* rhs_packed, float* dst, int64_t dst_stride,
                  const Q4GemmEpilogue& ep);
};

/// Every variant compiled into this build, best first; the portable one is always last.
const std::vector<const Q4GemmUkernel*>& q4gemm_registry();

/// The best variant this CPU runs whose level is at most @p cap (nullptr: no cap beyond
/// CPUMOE_ISA). CPUMOE_ISA, when set, caps further. Never returns nullptr.
const Q4GemmUkernel* q4gemm_select(const Isa* cap = nullptr);

/// The variant named @p name (nullptr if not compiled in).
const Q4GemmUkernel* q4gemm_find(const char* name);

}  // namespace cpumoe
