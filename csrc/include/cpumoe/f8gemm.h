/// @file f8gemm.h
/// The W8A16 FP8 GEMM microkernel family (the fp8 weight format's kernels): bf16 activations
/// times float8 E4M3 weights with one fp32 scale per block of the weight matrix, fp32 out. One
/// interface struct that every ISA variant fills in, and the registry that lists the variants
/// best first.
///
/// The weight B [n][k] is E4M3 codes (OCP float8 e4m3fn: sign bit 7, exponent bits 6-3 with
/// bias 7, mantissa bits 2-0; exponent 0 is subnormal, m / 8 * 2^-6; 0x7F and 0xFF are NaN and
/// never reach a kernel: prepack rejects them; there is no infinity). K is cut into groups of
/// `F8Layout::group` consecutive k, the last one shorter when group does not divide K; rows of
/// B are cut into blocks of `F8Layout::block_n`. Block (j / block_n, g) has one fp32 scale s.
/// A kernel computes, for each output,
///   C[i][j] = sum over groups g, in increasing order, of  S_g(i, j) * s[j / block_n][g],
///   S_g(i, j) = sum over k in group g of A[i][k] * e4m3(B[j][k])      (fp32)
/// then + bias[j]. A is bf16 (raw uint16_t bit patterns). Each product of a bf16 value and an E4M3
/// value is exact in fp32 (8 + 4 significant bits); the sums within a group are fp32 in an order of
/// the kernel's own (fixed for a given kernel and depth, whichever rows and columns a call covers
/// at offsets of multiples of mr / nr, so a kernel is deterministic however a GEMM is split into
/// calls; but two kernels may differ in the last bits, as bgemm's do). A kernel may fold a power of
/// two into the codes and the scale (E4M3 bits shifted into fp16 positions are the value times
/// 2^-8, exactly; the scale then times 2^8): the same real products, barring fp32 underflow (and
/// overflow of scales of 2^120 and beyond). Since every product is exact, a fused multiply-add
/// within a group gives the same sums as a multiply then an add. Subnormal bf16 inputs may be
/// treated as zero by the hardware paths (BFMMLA, VDPBF16PS, AMX do so).
///
/// The packed B layout kernels share (blocks of nr columns; per group the codes, then the nr
/// fp32 scales) is F8Packing in csrc/ukernels/f8gemm/f8gemm_common.h. W4A16 layers give 4-bit
/// codes instead (F8Layout::code_bits 4: indices into a 16-code codebook, two per byte), which
/// the kernels with F8GemmUkernel::codes4 expand in registers: the same weights, half the bytes.
///
/// Kernel names (f8gemm_<lhs>_<rhs>_<mr>x<nr>_<isa>, file name == kernel name) follow the
/// grammar in csrc/ukernels/README.md.
///
/// Packing pads the last group of K up to a multiple of kr with zero codes and zero A values,
/// and N up to a multiple of nr with zero columns, so a kernel is correct for every m >= 0,
/// n >= 0, k >= 1; callers never pad themselves.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpumoe/cpu_features.h"

namespace cpumoe {

/// How a packed FP8 weight matrix is blocked beyond its kernel.
struct F8Layout {
  /// k per scale group: a multiple of kF8GroupMultiple, or any value >= k (one group: per
  /// output channel when block_n is 1).
  int64_t group = 128;
  /// Rows of B (output columns) per scale block: >= 1 (1: a scale per column).
  int64_t block_n = 128;
  /// Bits of one stored weight code: 8 (the E4M3 code itself) or 4 (W4A16: an index into
  /// `codebook`, two per byte, half the bytes read; only for kernels with
  /// F8GemmUkernel::codes4). The weight is then e4m3(codebook[index]); everything else, the
  /// arithmetic included, is as for 8-bit codes, so both forms of the same weights give the same
  /// bits.
  int64_t code_bits = 8;
  /// code_bits 4: the E4M3 code of each index (none NaN, at least one of value zero: the
  /// packing's padding). Unused for 8-bit codes.
  std::array<uint8_t, 16> codebook{};
};

/// The index of the first zero (+0 or -0) in @p w's codebook, or -1 if it has none.
inline int f8_codebook_zero(const F8Layout& w) {
  for (int i = 0; i < 16; ++i)
    if ((w.codebook[size_t(i)] & 0x7F) == 0) return i;
  return -1;
}

/// Every group size below K is a multiple of this, so every group but the last is a multiple of
/// each kernel's kr.
constexpr int64_t kF8GroupMultiple = 32;

/// The number of scale groups along a depth of @p k: ceil(k / group).
inline int64_t f8_groups(int64_t k, const F8Layout& w) {
  return w.group >= k ? 1 : (k + w.group - 1) / w.group;
}

/// The epilogue of F8GemmUkernel::run_f32 (the weight scales live in the packed B) and the
/// call's scratch.
struct F8GemmEpilogue {
  const float* bias = nullptr;  ///< [n] or nullptr, from the first column of the call
  /// dst is large and not read again soon (QGemmEpilogue::stream_dst); same values either way.
  bool stream_dst = false;
  /// F8GemmUkernel::scratch_bytes(m, n, k, w) bytes, 64-byte aligned, that the call may
  /// overwrite (contents in and out undefined); may be nullptr when that is 0. The caller owns
  /// it: kernels never allocate.
  void* scratch = nullptr;
};

/// One FP8 microkernel variant. Sizes in elements; pointers non-null where their size is
/// non-zero. Packed buffers are 64-byte aligned by the callers; kernels use unaligned loads.
struct F8GemmUkernel {
  const char* name;  ///< the kernel's name in the grammar above
  Isa isa;           ///< the ISA level it needs at run time
  int64_t mr;        ///< rows of the main register tile; lhs offsets are taken at multiples of it
  int64_t nr;        ///< columns of a packed B block; rhs offsets are taken at multiples of it
  int64_t kr;        ///< divides kF8GroupMultiple; the last group is padded to a multiple of it
  /// Takes F8Layout::code_bits 4 (4-bit indices into a codebook) besides 8.
  bool codes4;

  /// Bytes of packed A for @p m rows of depth @p k.
  size_t (*lhs_packed_size)(int64_t m, int64_t k);
  /// Byte offset of row @p m_idx (a multiple of mr) in packed A of depth @p k.
  size_t (*lhs_packed_offset)(int64_t m_idx, int64_t k);
  /// Packs @p m bf16 rows of depth @p k (row i from rows[i][0..k), bf16 bits); row pieces at
  /// multiples of mr write what one call writes there (BGemmUkernel::pack_lhs).
  void (*pack_lhs)(int64_t m, int64_t k, const uint16_t* const* rows, void* lhs_packed);

  /// Bytes of packed B (codes and scales) for @p n output columns of depth @p k.
  size_t (*rhs_packed_size)(int64_t n, int64_t k, const F8Layout& w);
  /// Byte offset of output column @p n_idx (a multiple of nr) in packed B; a multiple of 64.
  size_t (*rhs_packed_offset)(int64_t n_idx, int64_t k, const F8Layout& w);
  /// Packs B: column j's k E4M3 codes at codes + j * code_stride (w.code_bits 4: codebook
  /// indices 0..15, one per byte; the codebook is w's: @pre codes4 and f8_codebook_zero(w) >= 0);
  /// the scale of column j's group g at scales[(j / w.block_n) * scale_stride + g] (fp32,
  /// finite; f8_groups(k, w) per block row). Every column's codes and scales are read, nothing
  /// else.
  void (*pack_rhs)(int64_t n, int64_t k, const F8Layout& w, const uint8_t* codes,
                   int64_t code_stride, const float* scales, int64_t scale_stride,
                   void* rhs_packed);

  /// Bytes of scratch one run_f32 call of this shape needs (F8GemmEpilogue::scratch), 0 for
  /// kernels that need none. Non-decreasing in @p m and @p n, so a caller reserves it once at
  /// the largest shape it will call (the MoE planner: a task's rows and columns, k = H or I).
  size_t (*scratch_bytes)(int64_t m, int64_t n, int64_t k, const F8Layout& w);

  /// dst[i * dst_stride + j] = C[i][j] as in the file comment (+ bias[j] when ep.bias is not
  /// null), for i < m, j < n; nothing else of dst is written. @p lhs_packed / @p rhs_packed point
  /// at row 0 / column 0 of the call (use the offsets).
  /// @pre ep.scratch holds scratch_bytes(m, n, k, w) bytes, 64-byte aligned, used by no other
  ///      call at the same time.
  void (*run_f32)(int64_t m, int64_t n, int64_t k, const F8Layout& w, const void* lhs_packed,
                  const void* rhs_packed, float* dst, int64_t dst_stride,
                  const F8GemmEpilogue& ep);
};

/// The real value of the E4M3 code @p c (NaN for 0x7F and 0xFF).
inline float e4m3_value(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  float v;
  if ((c & 0x7F) == 0x7F) {
    v = std::nanf("");
  } else if (e == 0) {
    v = float(m) * (1.0f / 512.0f);  // m / 8 * 2^-6
  } else {
    v = std::ldexp(1.0f + float(m) * 0.125f, e - 7);
  }
  return (c & 0x80) ? -v : v;
}

/// Every variant compiled into this build, best first; the portable one is always last.
const std::vector<const F8GemmUkernel*>& f8gemm_registry();

/// The best variant this CPU runs whose level is at most @p cap (nullptr: no cap beyond
/// CPUMOE_ISA). CPUMOE_ISA, when set, caps further. Never returns nullptr.
const F8GemmUkernel* f8gemm_select(const Isa* cap = nullptr);

/// The variant named @p name (nullptr if not compiled in).
const F8GemmUkernel* f8gemm_find(const char* name);

}  // namespace cpumoe
