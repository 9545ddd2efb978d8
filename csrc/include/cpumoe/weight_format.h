/// @file weight_format.h
/// The weight formats of the MoE ops: one table (kWeightFormatTable), one row per format, that
/// says what a packed layer of the format holds and which kernel family reads it. The name
/// parser, the 4-bit layout's scale size (W4Layout::scale_bytes), the W4A8 packer's checks, the
/// scratch bound over every layout, the bindings (packed.weight_format, prepack_w4's format
/// argument, cpumoe._C.formats()) and the Python package (cpumoe.formats(), cpumoe.FORMATS) all
/// read this table instead of naming the formats themselves.
///
/// Header-only, constexpr, no ISA features: the kernels include it through q4gemm.h.
///
/// Adding a format (docs/adding-a-format.md has the whole list):
///  - an enumerator of WeightFormat and its row of kWeightFormatTable, in enum order;
///  - a format read by an existing family (4-bit codes decoding to int8 values with a scale per
///    group: q4gemm) also needs its W4Format enumerator (the same value), its 16-entry decode
///    table (w4_decode_table, csrc/ukernels/q4gemm/w4_format.cpp), its scale decode in
///    q4gemm_common.h where the scale is not fp32, the decode in each ISA kernel, its input form
///    in W4Packer (csrc/moe/packed.cpp) and the oracle's decode (tests_cpp/reference);
///  - a format that needs another GEMM (FP8 weights with bf16 activations, say) needs a kernel
///    family of its own: a KernelFamily enumerator, the family header and registry, its
///    moe_detail::Family, a Packed class and its fused_moe_* overload, as bf16 has;
///  - in Python, its prepack function (the row's `prepack`), the reference and the quantizer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

namespace cpumoe {

/// The weight formats, in table order (their values index kWeightFormatTable). The prepack input
/// of each (w13 for [E, 2I, H], w2 for [E, H, I]; N, K those of one matrix):
///   - int8:  int8 [E, N, K]; fp32 scales [E, N], one per output channel.
///   - int4:  int8 [E, N, K] holding values in [-8, 7]; fp32 scales [E, N, K / g], one per group
///            of k, finite (negative and zero too: GGUF's Q4_0 has both).
///   - mxfp4: gpt-oss's layout: uint8 [E, N, K / 32, 16], two E2M1 codes per byte, the low nibble
///            first (k even); uint8 E8M0 scales [E, N, K / 32] (255 is NaN: its group's outputs
///            are NaN).
///   - bf16:  bf16 [E, N, K], no scale.
///   - int4_affine: uint8 [E, N, K] holding codes in [0, 15]; fp32 (scale, min) pairs
///            [E, N, K / g, 2], finite (any sign): w = scale * code + min (AWQ, asymmetric GPTQ,
///            GGUF Q4_1 / Q4_K). Packed as int4 values code - 8 with the scale (the q4gemm
///            kernels) plus an fp32 offset o = min + 8 * scale per group, which the pipeline
///            applies to the exact int32 group sums of the activations (RowOps::add_group_offsets).
///   - int8_affine: uint8 [E, N, K] codes in [0, 255]; fp32 (scale, min) pairs [E, N, K / g, 2]
///            as int4_affine: w = scale * code + min (GGUF Q8_0 with min = -128 * scale, Q5_0,
///            Q5_1, Q5_K). Kernels with 8-bit codes (Q4GemmUkernel::codes8) run the values
///            code - 128 with the scale, plus the offset min + 128 * scale; the others two
///            int4_affine planes, code = 16 hi + lo (cpumoe::W4Plan in q4gemm.h).
///   - fp8:   float8 E4M3 (e4m3fn) codes uint8 [E, N, K] (0x7F and 0xFF, NaN, are refused); fp32
///            scales [E, ceil(N / bn), ceil(K / bk)], finite and >= 0, one per block of bn rows
///            and bk k (the last blocks partial): w = e4m3(code) * s (HF's weight_scale_inv).
enum class WeightFormat : int32_t {
  int8 = 0,   ///< int8, fp32 scale per output channel (W8A8)
  int4 = 1,   ///< int4, fp32 scale per group of k (W4A8)
  mxfp4 = 2,  ///< OCP MXFP4: E2M1 codes, an E8M0 scale per block of 32 k (W4A8)
  bf16 = 3,   ///< bf16, no scale (the BF16 op)
  fp8 = 4,    ///< float8 E4M3, an fp32 scale per block of bn x bk (W8A16: the BF16 op's pipeline)
  int4_affine = 5,  ///< unsigned 4-bit codes, an fp32 scale and min per group of k (W4A8)
  int8_affine = 6,  ///< unsigned 8-bit codes, an fp32 scale and min per group of k (W4A8: W4Plan)
};

/// The kernel family that reads a format's packed weights (qgemm.h, q4gemm.h, bgemm.h,
/// f8gemm.h).
enum class KernelFamily : int32_t { qgemm, q4gemm, bgemm, f8gemm };

/// What one weight scale applies to, and its type.
enum class ScaleKind : int32_t {
  none,              ///< no scale (the values are the weights)
  fp32_per_channel,  ///< one fp32 per output channel
  fp32_per_group,    ///< one fp32 per group of `group` consecutive k of an output channel
  e8m0_per_block,    ///< one E8M0 byte (2^(e - 127), 255 NaN) per block of 32 k
  fp32_per_block,    ///< one fp32 per block of bn output channels x bk k (2-D blocks)
  fp32_scale_min_per_group,  ///< an fp32 (scale, min) pair per group of `group` k
};

/// Which group sizes a format takes.
enum class GroupRule : int32_t {
  none,      ///< no groups (per-channel or no scale)
  multiple,  ///< any multiple of group_size up to group_max
  exact,     ///< exactly group_size
  block,     ///< 2-D blocks of bn x bk: bk a multiple of group_size or >= K (one group), any bn
};

/// Every group size is a multiple of this (a format with one fixed block has exactly this).
constexpr int64_t kW4GroupMultiple = 32;
/// A 2-D block's k extent (GroupRule::block) is a multiple of this unless it spans K (f8gemm.h's
/// kF8GroupMultiple).
constexpr int64_t kF8BlockMultiple = 32;
/// The largest group a packed layer takes: the kernels' int32 group sums (some hold the values
/// times 16) stay exact up to here with room to spare (65536 * 127 * 8 * 16 < 2^31).
constexpr int64_t kW4MaxGroup = 65536;

/// One row of the format table.
struct WeightFormatInfo {
  WeightFormat format;
  const char* name;        ///< packed.weight_format, the prepack_w4 format argument
  int bits;                ///< bits per weight in the packed layer
  const char* value_code;  ///< how a weight's bits read: "int" (two's complement), "uint",
                           ///< "e2m1", "bf16", "e4m3"
  ScaleKind scale;
  int scale_bytes;         ///< bytes of one scale in prepack's input (0: no scale)
  GroupRule group;
  int64_t group_size;      ///< the multiple (GroupRule::multiple) or the size (exact); else 0
  int64_t group_max;       ///< the largest group (0 without groups or without a bound)
  bool zero_point;         ///< stores a zero point / min per scale (int4_affine)
  KernelFamily family;
  const char* activations;  ///< the op's activation type: "int8" (quantized per token), "bf16"
  const char* prepack;      ///< the Python function that packs it (cpumoe.<prepack>)
};

/// Every weight format, in enum order.
inline constexpr WeightFormatInfo kWeightFormatTable[] = {
    {WeightFormat::int8, "int8", 8, "int", ScaleKind::fp32_per_channel, 4, GroupRule::none, 0, 0,
     false, KernelFamily::qgemm, "int8", "prepack"},
    {WeightFormat::int4, "int4", 4, "int", ScaleKind::fp32_per_group, 4, GroupRule::multiple,
     kW4GroupMultiple, kW4MaxGroup, false, KernelFamily::q4gemm, "int8", "prepack_int4"},
    {WeightFormat::mxfp4, "mxfp4", 4, "e2m1", ScaleKind::e8m0_per_block, 1, GroupRule::exact,
     kW4GroupMultiple, kW4GroupMultiple, false, KernelFamily::q4gemm, "int8", "prepack_mxfp4"},
    {WeightFormat::bf16, "bf16", 16, "bf16", ScaleKind::none, 0, GroupRule::none, 0, 0, false,
     KernelFamily::bgemm, "bf16", "prepack_bf16"},
    {WeightFormat::fp8, "fp8", 8, "e4m3", ScaleKind::fp32_per_block, 4, GroupRule::block,
     kF8BlockMultiple, 0, false, KernelFamily::f8gemm, "bf16", "prepack_fp8"},
    {WeightFormat::int4_affine, "int4_affine", 4, "uint", ScaleKind::fp32_scale_min_per_group, 8,
     GroupRule::multiple, kW4GroupMultiple, kW4MaxGroup, true, KernelFamily::q4gemm, "int8",
     "prepack_int4_affine"},
    {WeightFormat::int8_affine, "int8_affine", 8, "uint", ScaleKind::fp32_scale_min_per_group, 8,
     GroupRule::multiple, kW4GroupMultiple, kW4MaxGroup, true, KernelFamily::q4gemm, "int8",
     "prepack_int8_affine"},
};
inline constexpr int kNumWeightFormats =
    int(sizeof(kWeightFormatTable) / sizeof(kWeightFormatTable[0]));

constexpr bool weight_format_table_in_order() {
  for (int i = 0; i < kNumWeightFormats; ++i)
    if (int(kWeightFormatTable[i].format) != i) return false;
  return true;
}
static_assert(weight_format_table_in_order(),
              "kWeightFormatTable: one row per enumerator, in enum order");

/// The row of @p f (the first row for a value outside the enum).
constexpr const WeightFormatInfo& weight_format_info(WeightFormat f) {
  const int i = int(f);
  return kWeightFormatTable[i >= 0 && i < kNumWeightFormats ? i : 0];
}
constexpr const char* weight_format_name(WeightFormat f) { return weight_format_info(f).name; }

/// The row's scale_bytes of @p f (0 outside the enum) as a chain of compares against constants:
/// it never reads the table at run time, so code built with ISA flags (the kernels, through
/// W4Layout::scale_bytes) shares no table object with the rest of the library (the IsaObjects
/// test of tests_cpp).
template <std::size_t... I>
[[gnu::always_inline]] constexpr int weight_format_scale_bytes(WeightFormat f,
                                                             std::index_sequence<I...>) {
  int out = 0;
  ((int(f) == int(I) ? void(out = kWeightFormatTable[I].scale_bytes) : void()), ...);
  return out;
}
[[gnu::always_inline]] constexpr int weight_format_scale_bytes(WeightFormat f) {
  return weight_format_scale_bytes(f, std::make_index_sequence<kNumWeightFormats>{});
}

/// Parses a format name ("int8", ..., see kWeightFormatTable). False for anything else.
inline bool parse_weight_format(const char* s, WeightFormat* out) {
  for (const WeightFormatInfo& info : kWeightFormatTable) {
    if (std::strcmp(s, info.name) == 0) {
      *out = info.format;
      return true;
    }
  }
  return false;
}

/// The names of the rows @p keep(row) accepts, ", "-separated ("int4, mxfp4"): for messages.
template <class Keep>
std::string weight_format_names_if(const Keep& keep) {
  std::string out;
  for (const WeightFormatInfo& info : kWeightFormatTable)
    if (keep(info)) out += (out.empty() ? "" : ", ") + std::string(info.name);
  return out;
}
/// The names of every format ("int8, int4, mxfp4, bf16, ...").
inline std::string weight_format_names() {
  return weight_format_names_if([](const WeightFormatInfo&) { return true; });
}
/// The names of the formats @p family reads.
inline std::string weight_format_names(KernelFamily family) {
  return weight_format_names_if([&](const WeightFormatInfo& i) { return i.family == family; });
}

/// The names of the enumerators above, for cpumoe._C.formats() (indexed by the enum's value).
constexpr const char* kernel_family_name(KernelFamily f) {
  constexpr const char* names[] = {"qgemm", "q4gemm", "bgemm", "f8gemm"};
  return unsigned(f) < 4 ? names[int(f)] : "?";
}
constexpr const char* scale_kind_name(ScaleKind k) {
  constexpr const char* names[] = {"none",           "fp32_per_channel", "fp32_per_group",
                                   "e8m0_per_block", "fp32_per_block",
                                   "fp32_scale_min_per_group"};
  return unsigned(k) < 6 ? names[int(k)] : "?";
}
constexpr const char* group_rule_name(GroupRule g) {
  constexpr const char* names[] = {"none", "multiple", "exact", "block"};
  return unsigned(g) < 4 ? names[int(g)] : "?";
}

/// Empty if format @p f takes group size @p g (with GroupRule::none: only g == 0; with
/// GroupRule::block, @p g is the block's k extent, checked against each depth by the packer),
/// else why not (the message starts with "group_size: ").
inline std::string weight_format_group_problem(WeightFormat f, int64_t g) {
  const WeightFormatInfo& info = weight_format_info(f);
  const std::string got = ", got " + std::to_string(g);
  switch (info.group) {
    case GroupRule::none:
      return g == 0 ? "" : std::string("group_size: ") + info.name + " has no groups" + got;
    case GroupRule::exact:
      return g == info.group_size ? ""
                                  : std::string("group_size: ") + info.name + " groups are " +
                                        std::to_string(info.group_size) + " k" + got;
    case GroupRule::block:
      return g >= 1 ? "" : "group_size: the block's k extent must be >= 1" + got;
    case GroupRule::multiple:
      if (g < info.group_size || g % info.group_size != 0)
        return "group_size: must be a positive multiple of " + std::to_string(info.group_size) +
               got;
      if (g > info.group_max)
        return "group_size: at most " + std::to_string(info.group_max) +
               " (the kernels' int32 group sums)" + got;
      return "";
  }
  return "group_size: ?";
}

}  // namespace cpumoe
