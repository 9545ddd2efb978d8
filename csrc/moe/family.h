// What the pipeline needs to know about a kernel family besides its interface struct: how a GEMM
// input row is made (int8: quantized, with a scale; bf16: rounded) and the GEMM epilogue (int8:
// row and column scales and the bias; bf16: the bias only), and the scratch a GEMM call needs
// (kernel_scratch: none but W4A8's). The pipeline calls these at each step and is the same for
// every family.
#pragma once

#include <algorithm>
#include <cstdint>

#include "bench_hooks.h"
#include "cpumoe/moe.h"
#include "scratch.h"
#include "tiling.h"

namespace cpumoe {
namespace moe_detail {

template <class Kernel>
struct Family;

template <>
struct Family<QGemmUkernel> {
  using Elem = int8_t;  // a GEMM input element: quantized
  using Packed = PackedMoe;

  // Whether x of dtype dt serves as GEMM input rows as it is.
  static bool x_in_place(DType) { return false; }
  // Step 1: token row x (n elements of dt) -> q, *scale. With groups > 0 (ActQuant::group: see
  // act_groups), one scale per n / groups values into gscale, and *scale = 1 (exact in the
  // epilogue's multiply).
  static void input_row(const RowOps& ro, const void* x, DType dt, int64_t n, Elem* q,
                        float* scale, float* gscale, int64_t groups) {
    if (groups == 0) {
      *scale = ro.quantize(x, dt, n, q);
      return;
    }
    const int64_t g = n / groups, bytes = g * dtype_size(dt);
    for (int64_t gi = 0; gi < groups; ++gi)
      gscale[gi] = ro.quantize(static_cast<const uint8_t*>(x) + gi * bytes, dt, g, q + gi * g);
    *scale = 1.0f;
  }
  // Step 3: the scale of a gathered row.
  static void gather_scale(float* dst, const float* src) { *dst = *src; }
  // Step 5: GEMM1 row h (2 * inter values) -> q, *scale, through tmp (inter floats); groups
  // and gscale as input_row.
  static void activate(const RowOps& ro, const ActivationSpec& act, const float* h, int64_t inter,
                       DType dt, float* tmp, Elem* q, float* scale, float* gscale,
                       int64_t groups) {
    const float amax = ro.activate_round(act, h, inter, dt, tmp);  // the row rounded to dt
    CPUMOE_BENCH_STEP(bench_hooks::requant);
    if (groups == 0) {
      *scale = ro.quantize_with_amax(tmp, inter, amax, q);
      return;
    }
    input_row(ro, tmp, DType::f32, inter, q, scale, gscale, groups);
  }
  // The output-channel scales of expert e's w13 / w2.
  static const float* scale13(const Packed& pk, int64_t e) { return pk.s13(e); }
  static const float* scale2(const Packed& pk, int64_t e) { return pk.s2(e); }
  // Byte offset of output column n0 in an expert's packed weights of depth `depth`.
  static size_t rhs_offset(const QGemmUkernel& kern, const Packed&, int64_t n0, int64_t depth) {
    return kern.rhs_packed_offset(n0, depth);
  }
  // Bytes of scratch one GEMM call of a chunk needs at most: see Family<Q4GemmUkernel>.
  static size_t kernel_scratch(const QGemmUkernel&, const Packed*, int64_t, int64_t, int64_t) {
    return 0;
  }
  // Group sums per GEMM input row of depth `depth` the epilogue needs (int4_affine), 0 for none.
  // (Templates: the derived families of other layers inherit them.)
  template <class AnyPacked>
  static int64_t groups(const AnyPacked*, int64_t) {
    return 0;
  }
  // Scales per GEMM input row of depth `depth` (ActQuant::group), 0 for one per row.
  template <class AnyPacked>
  static int64_t act_groups(const AnyPacked*, int64_t) {
    return 0;
  }
  // Row q's group sums (groups(pk, depth) of them) into out, each times its group scale when
  // gscale (the row's act_groups scales) is given.
  template <class AnyPacked>
  static void sums(const RowOps&, const AnyPacked&, const Elem*, int64_t, float*, const float*) {}
  // One task's GEMM with its epilogue (its columns [tk.n0, tk.n0 + tk.n) of the matrix's
  // n_total); row_scale, gscale (the rows' group scales, when act_groups says there are, else
  // nullptr) and sums (the rows' group sums, when groups says there are) at the task's first
  // row, col_scale and bias (nullable) at the expert's column 0; scratch: the thread's
  // kernel_scratch bytes.
  // stream: dst is large and read only later (QGemmEpilogue::stream_dst).
  static void run(const QGemmUkernel& kern, const Packed&, const Task& tk, int64_t, int64_t depth,
                  const float*, const void* lhs, const void* rhs, float* dst, int64_t dst_stride,
                  const float* row_scale, const float*, const float* col_scale,
                  const float* bias, void*, bool stream = false) {
    const QGemmEpilogue ep{row_scale, col_scale + tk.n0, bias ? bias + tk.n0 : nullptr, stream};
    kern.run_f32(tk.m, tk.n, depth, lhs, rhs, dst, dst_stride, ep);
  }
};

template <>
struct Family<BGemmUkernel> {
  using Elem = uint16_t;  // bf16 bits
  using Packed = PackedMoeBf16;

  static bool x_in_place(DType dt) { return dt == DType::bf16; }
  static void input_row(const RowOps& ro, const void* x, DType dt, int64_t n, Elem* q, float*,
                        float*, int64_t) {
    ro.to_bf16(x, dt, n, q);
  }
  static void gather_scale(float*, const float*) {}
  static void activate(const RowOps& ro, const ActivationSpec& act, const float* h, int64_t inter,
                       DType, float*, Elem* q, float*, float*, int64_t) {
    ro.activate_bf16(act, h, inter, q);
  }
  static const float* scale13(const Packed&, int64_t) { return nullptr; }
  static const float* scale2(const Packed&, int64_t) { return nullptr; }
  static size_t rhs_offset(const BGemmUkernel& kern, const Packed&, int64_t n0, int64_t depth) {
    return kern.rhs_packed_offset(n0, depth);
  }
  static size_t kernel_scratch(const BGemmUkernel&, const Packed*, int64_t, int64_t, int64_t) {
    return 0;
  }
  template <class AnyPacked>
  static int64_t groups(const AnyPacked*, int64_t) {
    return 0;
  }
  template <class AnyPacked>
  static int64_t act_groups(const AnyPacked*, int64_t) {
    return 0;
  }
  template <class AnyPacked>
  static void sums(const RowOps&, const AnyPacked&, const Elem*, int64_t, float*, const float*) {}
  static void run(const BGemmUkernel& kern, const Packed&, const Task& tk, int64_t, int64_t depth,
                  const float*, const void* lhs, const void* rhs, float* dst, int64_t dst_stride,
                  const float*, const float*,
                  const float*, const float* bias, void*, bool = false) {
    kern.run_f32(tk.m, tk.n, depth, lhs, rhs, dst, dst_stride, bias ? bias + tk.n0 : nullptr);
  }
};

// W4A8: the int8 family's input rows, activation and requantization; the weight scales live in
// the packed blocks, so the epilogue has the row scale and the bias only, and for int4_affine
// the group offsets (the "column scales" here), added after the kernel from the input rows.
template <>
struct Family<Q4GemmUkernel> : Family<QGemmUkernel> {
  using Packed = PackedMoeW4;
  static const float* scale13(const Packed& pk, int64_t e) { return pk.o13(e); }
  static const float* scale2(const Packed& pk, int64_t e) { return pk.o2(e); }
  static size_t rhs_offset(const Q4GemmUkernel& kern, const Packed& pk, int64_t n0,
                           int64_t depth) {
    return kern.rhs_packed_offset(n0, depth, pk.layout());
  }
  // The kernel's scratch_bytes (64-byte multiple) at the largest call of a chunk: m rows (a
  // task's), GEMM1 n <= 2I at k = H, GEMM2 n <= H at k = I (scratch_bytes grows with m and n),
  // and for two-plane layers (int8_affine) the lo plane's [m, n] fp32 tile after it.
  // For the packed layer's layout, or (pk == nullptr: fused_moe_scratch_bytes of a kernel) the
  // most over every layout an E x H x I layer can have: each q4gemm row of the format table with
  // each group its rule allows that divides H and I.
  static size_t kernel_scratch(const Q4GemmUkernel& kern, const Packed* pk, int64_t m, int64_t H,
                               int64_t I) {
    auto at = [&](const W4Layout& w) {
      return std::max(kern.scratch_bytes(m, 2 * I, H, w), kern.scratch_bytes(m, H, I, w));
    };
    const size_t tile = align_up(size_t(m) * size_t(std::max(2 * I, H)) * sizeof(float));
    if (pk != nullptr) return align_up(at(pk->layout())) + (pk->planes() > 1 ? tile : 0);
    size_t most = 0;
    for (const WeightFormatInfo& info : kWeightFormatTable) {
      W4Format f;
      if (!w4_format_of(info.format, &f)) continue;
      const int64_t step = info.group_size;  // exact: one size; multiple: each multiple
      const int64_t last = info.group == GroupRule::exact ? step : info.group_max;
      for (int64_t g = step; g <= std::min({H, I, last}); g += step)
        if (H % g == 0 && I % g == 0)
          most = std::max(most, at(W4Layout{w4_plan(f, kern.codes8).kernel, g}));
    }
    return align_up(most) + tile;
  }
  // The affine formats: the group sums of every input row (for its offsets); pk == nullptr: the
  // most any layer of these sizes has (groups of kW4GroupMultiple).
  static int64_t groups(const Packed* pk, int64_t depth) {
    if (pk == nullptr) return depth / kW4GroupMultiple;
    return pk->o13(0) != nullptr ? depth / pk->group_size() : 0;  // offsets to apply
  }
  // ActQuant::group: a scale per weight group of every input row; pk == nullptr: the most any
  // layer of these sizes has.
  static int64_t act_groups(const Packed* pk, int64_t depth) {
    if (pk == nullptr) return depth / kW4GroupMultiple;
    return pk->act_quant() == ActQuant::group ? depth / pk->group_size() : 0;
  }
  // The group sums times the group scales (when given): the offsets' term then needs no row
  // scale (which is 1 with group scales).
  static void sums(const RowOps& ro, const Packed& pk, const Elem* q, int64_t depth, float* out,
                   const float* gscale) {
    ro.group_sums(q, depth, pk.group_size(), out);
    if (gscale != nullptr)
      for (int64_t gi = 0; gi < depth / pk.group_size(); ++gi) out[gi] = out[gi] * gscale[gi];
  }
  // The affine formats: the group offsets added after the kernel (dst not streamed past the
  // caches: it is read right back). Calls in column blocks, to add each block's offsets while
  // it is in L1, measured slower (Qwen3 T=128, AVX-512: 12.3-13.2 ms against 11.9-12.2).
  // Two planes (int8_affine): the hi plane into dst (with the bias), the lo plane into an fp32
  // tile in scratch after the kernel's (with its own offsets), then dst + tile.
  static void run(const Q4GemmUkernel& kern, const Packed& pk, const Task& tk, int64_t n_total,
                  int64_t depth, const float* sums, const void* lhs, const void* rhs, float* dst,
                  int64_t dst_stride, const float* row_scale, const float* gscale,
                  const float* offsets, const float* bias, void* scratch, bool stream = false) {
    const Q4GemmEpilogue ep{row_scale, bias ? bias + tk.n0 : nullptr,
                            stream && offsets == nullptr, scratch, gscale};
    const int64_t groups = depth / pk.group_size();
    const RowOps& ro = *pk.config().rowops;
    kern.run_f32(tk.m, tk.n, depth, pk.layout(), lhs, rhs, dst, dst_stride, ep);
    if (offsets != nullptr)
      ro.add_group_offsets(tk.m, tk.n0, tk.n, groups, sums, offsets, row_scale, dst, dst_stride);
    if (pk.planes() == 1) return;
    float* tile = reinterpret_cast<float*>(
        static_cast<uint8_t*>(scratch) +
        align_up(kern.scratch_bytes(tk.m, tk.n, depth, pk.layout())));
    const Q4GemmEpilogue ep_lo{row_scale, nullptr, false, scratch, gscale};
    kern.run_f32(tk.m, tk.n, depth, pk.layout(), lhs,
                 static_cast<const uint8_t*>(rhs) + pk.plane_bytes(n_total, depth), tile, tk.n,
                 ep_lo);
    ro.add_group_offsets(tk.m, tk.n0, tk.n, groups, sums,
                         offsets + group_offset_floats(n_total, depth, pk.group_size()), row_scale,
                         tile, tk.n);
    for (int64_t i = 0; i < tk.m; ++i) {
      float* d = dst + i * dst_stride;
      const float* t = tile + i * tk.n;
      for (int64_t j = 0; j < tk.n; ++j) d[j] = d[j] + t[j];
    }
  }
};

// FP8 weights (W8A16): the BF16 op's input rows and activation; the block scales live in the
// packed blocks, so the epilogue has the bias only.
template <>
struct Family<F8GemmUkernel> : Family<BGemmUkernel> {
  using Packed = PackedMoeFp8;
  static const float* scale13(const Packed&, int64_t) { return nullptr; }
  static const float* scale2(const Packed&, int64_t) { return nullptr; }
  static size_t rhs_offset(const F8GemmUkernel& kern, const Packed& pk, int64_t n0,
                           int64_t depth) {
    return kern.rhs_packed_offset(n0, depth, pk.layout());
  }
  // The kernel's scratch_bytes at the largest call of a chunk, as Family<Q4GemmUkernel>: for
  // the packed layer's layout, or (pk == nullptr) the most over every block an E x H x I layer
  // can have (k extents: each multiple of kF8BlockMultiple below the depths, and one group;
  // block_n does not change a kernel's scratch).
  static size_t kernel_scratch(const F8GemmUkernel& kern, const Packed* pk, int64_t m, int64_t H,
                               int64_t I) {
    auto at = [&](const F8Layout& w) {
      return std::max(kern.scratch_bytes(m, 2 * I, H, w), kern.scratch_bytes(m, H, I, w));
    };
    if (pk != nullptr) return align_up(at(pk->layout()));
    size_t most = at(F8Layout{std::max(H, I), 1});
    for (int64_t g = kF8BlockMultiple; g < std::max(H, I); g += kF8BlockMultiple)
      most = std::max(most, at(F8Layout{g, 1}));
    return align_up(most);
  }
  static void run(const F8GemmUkernel& kern, const Packed& pk, const Task& tk, int64_t,
                  int64_t depth,
                  const float*, const void* lhs, const void* rhs, float* dst, int64_t dst_stride,
                  const float*, const float*,
                  const float*, const float* bias, void* scratch, bool stream = false) {
    const F8GemmEpilogue ep{bias ? bias + tk.n0 : nullptr, stream, scratch};
    kern.run_f32(tk.m, tk.n, depth, pk.layout(), lhs, rhs, dst, dst_stride, ep);
  }
};

}  // namespace moe_detail
}  // namespace cpumoe
