// The packed layers (moe.h): PackedExperts packs every family's weights for the kernel of the
// layer's config; PackedMoe adds the int8 scales; the W4A8 and fp8 packers check their formats'
// values and hand each expert's matrices to the kernel's pack_rhs.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <tuple>
#include <utility>

#include "cpumoe/moe.h"
#include "parallel.h"
#include "scratch.h"
#include "validate.h"

namespace cpumoe {

using moe_detail::fail;

namespace {

std::unique_ptr<float[]> to_f32(const void* p, DType dt, int64_t n) {
  std::unique_ptr<float[]> out(new float[size_t(n)]);
  for (int64_t i = 0; i < n; ++i) out[i] = load_as_f32(p, dt, i);
  return out;
}

// "<name>: <what> = <v> must be a positive multiple of kDimMultiple" unless v is one.
void check_dim(int64_t v, const char* what) {
  if (v < kDimMultiple || v % kDimMultiple != 0)
    fail(std::string(what) + " = " + std::to_string(v) + " must be a positive multiple of " +
         std::to_string(kDimMultiple));
}

// bytes * n for the packed weight blocks, or an ArgumentError.
size_t checked_bytes(size_t bytes, int64_t n, const char* what) {
  size_t r = 0;
  if (__builtin_mul_overflow(bytes, size_t(n), &r))
    fail(std::string(what) + ": packed size " + std::to_string(bytes) + " * " +
         std::to_string(n) + " experts overflows size_t");
  return r;
}

}  // namespace

template <class Kernel>
void PackedExperts<Kernel>::AlignedFree::operator()(void* p) const {
  std::free(p);
}

// A plain weight matrix per expert (int8 or bf16 elements), packed by the kernel's pack_rhs.
template <class Kernel, class Elem>
struct PlainPacker final : RhsPacker {
  const Kernel* k;
  int64_t h, i;
  const Elem *w13, *w2;
  PlainPacker(const Kernel* kern, int64_t hidden, int64_t inter, const Elem* a, const Elem* b)
      : k(kern), h(hidden), i(inter), w13(a), w2(b) {}
  void check() const override {
    if (w13 == nullptr) fail("w13: missing");
    if (w2 == nullptr) fail("w2: missing");
  }
  size_t w13_bytes() const override { return k->rhs_packed_size(2 * i, h); }
  size_t w2_bytes() const override { return k->rhs_packed_size(h, i); }
  size_t scratch_bytes() const override { return 0; }  // int8 / bf16 pack_rhs need none
  void pack(int64_t e, void* d13, void* d2, void* /*scratch*/) const override {
    k->pack_rhs(2 * i, h, w13 + e * 2 * i * h, h, d13);
    k->pack_rhs(h, i, w2 + e * h * i, i, d2);
  }
};

template <class Kernel>
template <class Elem>
PackedExperts<Kernel>::PackedExperts(int64_t e, int64_t h, int64_t i,
                                     const MoeConfig<Kernel>& config, const Elem* w13,
                                     const Elem* w2, const void* b13, DType b13_dtype,
                                     const void* b2, DType b2_dtype, int num_threads)
    : PackedExperts(e, h, i, config, PlainPacker<Kernel, Elem>(config.gemm, h, i, w13, w2), b13,
                    b13_dtype, b2, b2_dtype, num_threads) {}

template <class Kernel>
PackedExperts<Kernel>::PackedExperts(int64_t e, int64_t h, int64_t i,
                                     const MoeConfig<Kernel>& config, const RhsPacker& packer,
                                     const void* b13, DType b13_dtype, const void* b2,
                                     DType b2_dtype, int num_threads)
    : e_(e), h_(h), i_(i), config_(config) {
  if (config_.gemm == nullptr || config_.rowops == nullptr)
    fail("config: kernel and row operations must be set (use int8_config / bf16_config)");
  if (e_ < 1) fail("w13: number of experts must be >= 1");
  check_dim(h_, "w13: hidden size H");
  check_dim(i_, "w2: intermediate size I");
  // The element counts of w13 [E, 2I, H] and w2 [E, H, I] (and so every smaller product below)
  // fit int64_t: absurd sizes from a malformed checkpoint are an error, not a wrapped size.
  using moe_detail::checked_mul;
  checked_mul(checked_mul(e_, checked_mul(2, i_, "w13"), "w13"), h_, "w13");
  checked_mul(checked_mul(e_, h_, "w2"), i_, "w2");
  packer.check();
  const Kernel& k = *config_.gemm;
  if (!cpu_supports(k.isa))
    fail(std::string("isa: kernel ") + k.name + " needs " + isa_name(k.isa) +
         ", which this CPU lacks");
  if (!cpu_supports(config_.rowops->isa))
    fail(std::string("config: row operations ") + config_.rowops->name + " need " +
         isa_name(config_.rowops->isa) + ", which this CPU lacks");
  // A hand-made policy must keep the task split well formed (a zero would divide by zero when
  // tasks are made).
  const MoeTilePolicy& tp = config_.tiles;
  if (tp.rows < 1 || tp.max_cols < 1 || tp.tasks_per_thread < 1)
    fail("config: tile policy rows, max_cols and tasks_per_thread must be >= 1");

  const int threads = moe_detail::resolve_threads(num_threads);
  w13_stride_ = moe_detail::align_up(packer.w13_bytes());
  w2_stride_ = moe_detail::align_up(packer.w2_bytes());
  w13_.reset(static_cast<uint8_t*>(moe_detail::alloc_large(checked_bytes(w13_stride_, e_, "w13"))));
  w2_.reset(static_cast<uint8_t*>(moe_detail::alloc_large(checked_bytes(w2_stride_, e_, "w2"))));
  if (!w13_ || !w2_) throw std::bad_alloc();
  // One scratch block per thread of the loop below, allocated here: an allocation failure is a
  // bad_alloc before any thread starts, and no packer allocates inside the region.
  const int team = int(std::min<int64_t>(threads, e_));
  const size_t scratch_stride = moe_detail::align_up(packer.scratch_bytes());
  std::unique_ptr<uint8_t, AlignedFree> scratch;
  if (scratch_stride > 0) {
    scratch.reset(static_cast<uint8_t*>(
        moe_detail::alloc_large(checked_bytes(scratch_stride, team, "pack scratch"))));
    if (!scratch) throw std::bad_alloc();
  }
  moe_detail::parallel_for(e_, team, [&](int64_t x, int tid) {
    packer.pack(x, w13_.get() + size_t(x) * w13_stride_, w2_.get() + size_t(x) * w2_stride_,
                scratch ? scratch.get() + size_t(tid) * scratch_stride : nullptr);
  });
  if (b13 != nullptr) {
    b13_ = to_f32(b13, b13_dtype, e_ * 2 * i_);
    has_b13_ = true;
  }
  if (b2 != nullptr) {
    b2_ = to_f32(b2, b2_dtype, e_ * h_);
    has_b2_ = true;
  }
}

template <class Kernel>
PackedExperts<Kernel>::~PackedExperts() = default;

template <class Kernel>
size_t PackedExperts<Kernel>::packed_bytes() const {
  size_t n = (w13_stride_ + w2_stride_) * size_t(e_) + extra_bytes_;
  if (has_b13_) n += size_t(e_ * 2 * i_) * 4;
  if (has_b2_) n += size_t(e_ * h_) * 4;
  return n;
}

template <class Kernel>
const void* PackedExperts<Kernel>::w13(int64_t e) const {
  return w13_.get() + size_t(e) * w13_stride_;
}
template <class Kernel>
const void* PackedExperts<Kernel>::w2(int64_t e) const {
  return w2_.get() + size_t(e) * w2_stride_;
}

template class PackedExperts<QGemmUkernel>;
template class PackedExperts<BGemmUkernel>;
template class PackedExperts<Q4GemmUkernel>;
template class PackedExperts<F8GemmUkernel>;

// The scales are checked before anything is packed (the base class packs in its constructor, so
// the check runs in the argument list); their copies are checked again after the copy, since the
// caller's memory may change in between and the copy is what the op reads.
static const MoeWeights& checked(const MoeWeights& w) {
  if (w.num_experts >= 1 && w.intermediate >= 1 && w.hidden >= 1) {
    using moe_detail::checked_mul;
    // Sizes first: scale counts that fit int64 but belong to absurd weights are not read.
    checked_mul(checked_mul(w.num_experts, checked_mul(2, w.intermediate, "w13"), "w13"), w.hidden,
                "w13");
    checked_mul(checked_mul(w.num_experts, w.hidden, "w2"), w.intermediate, "w2");
    moe_detail::check_scales(
        w.s13, checked_mul(w.num_experts, checked_mul(2, w.intermediate, "s13"), "s13"), "s13");
    moe_detail::check_scales(w.s2, checked_mul(w.num_experts, w.hidden, "s2"), "s2");
  }
  return w;
}

PackedMoe::PackedMoe(const MoeWeights& w, const QGemmUkernel* kernel, int num_threads)
    : PackedMoe(w, int8_config(kernel), num_threads) {}

PackedMoe::PackedMoe(const MoeWeights& w, const MoeConfig<QGemmUkernel>& config, int num_threads)
    : PackedExperts(checked(w).num_experts, w.hidden, w.intermediate, config, w.w13, w.w2, w.b13,
                    w.b13_dtype, w.b2, w.b2_dtype, num_threads) {
  const int64_t E = num_experts(), H = hidden(), I = intermediate();
  s13_.reset(new float[size_t(E * 2 * I)]);
  s2_.reset(new float[size_t(E * H)]);
  std::memcpy(s13_.get(), w.s13, size_t(E * 2 * I) * 4);
  std::memcpy(s2_.get(), w.s2, size_t(E * H) * 4);
  moe_detail::check_scales(s13_.get(), E * 2 * I, "s13");
  moe_detail::check_scales(s2_.get(), E * H, "s2");
  extra_bytes_ = size_t(E * (2 * I + H)) * 4;
}

namespace {

// Checks what the W4A8 weights' sizes and values must satisfy before anything is packed (the base
// class packs in its constructor, so this runs in the argument list). The packer masks every
// code to 4 bits, so memory the caller rewrites meanwhile can change values, never addresses.
const MoeWeightsW4& checked(const MoeWeightsW4& w) {
  using moe_detail::checked_mul;
  W4Format known;
  if (!w4_format_of(weight_format_of(w.format), &known))
    fail("format: must be one of " + weight_format_names(KernelFamily::q4gemm));
  if (w.act_quant != ActQuant::row && w.act_quant != ActQuant::group)
    fail("act_quant: must be ActQuant::row or ActQuant::group, got " +
         std::to_string(int32_t(w.act_quant)));
  const bool mx = w.format == W4Format::mxfp4;
  const bool affine = w4_affine(w.format);
  const bool bytes = w.format == W4Format::int8_affine;  // every uint8 code is a value
  const int64_t g = w.group_size;
  const std::string group_problem = weight_format_group_problem(weight_format_of(w.format), g);
  if (!group_problem.empty()) fail(group_problem);
  if (w.num_experts < 1 || w.hidden < 1 || w.intermediate < 1) return w;  // the base says why
  if (w.hidden % g != 0)
    fail("w13: hidden size H = " + std::to_string(w.hidden) + " is not a multiple of group_size " +
         std::to_string(g));
  if (w.intermediate % g != 0)
    fail("w2: intermediate size I = " + std::to_string(w.intermediate) +
         " is not a multiple of group_size " + std::to_string(g));
  const int64_t E = w.num_experts, H = w.hidden, I = w.intermediate;
  const int64_t n13 = checked_mul(checked_mul(E, checked_mul(2, I, "w13"), "w13"), H, "w13");
  const int64_t n2 = checked_mul(checked_mul(E, H, "w2"), I, "w2");
  if (w.s13 == nullptr) fail("s13: missing");
  if (w.s2 == nullptr) fail("s2: missing");
  if (mx) return w;  // every code and every E8M0 byte is a value (255: NaN)
  if (w.w13 == nullptr) fail("w13: missing");
  if (w.w2 == nullptr) fail("w2: missing");
  // int4: int8 values in [-8, 7]; int4_affine: uint8 codes in [0, 15].
  const int bias = affine ? 0 : 8;
  const char* what = affine ? ": int4_affine codes must be in [0, 15]"
                            : ": int4 values must be in [-8, 7]";
  for (auto [p, n, name] : {std::tuple{static_cast<const int8_t*>(w.w13), n13, "w13"},
                            std::tuple{static_cast<const int8_t*>(w.w2), n2, "w2"}}) {
    if (bytes) break;
    // Scanned in chunks without an early exit (so the loop vectorizes: a layer is ~10^9
    // values), the failing element looked up only in a chunk that has one.
    constexpr int64_t kChunk = int64_t(1) << 16;
    for (int64_t x0 = 0; x0 < n; x0 += kChunk) {
      const int64_t x1 = std::min(n, x0 + kChunk);
      uint8_t bad = 0;
      for (int64_t x = x0; x < x1; ++x) bad |= uint8_t(uint8_t(p[x] + bias) > 15);
      if (bad == 0) continue;
      for (int64_t x = x0; x < x1; ++x)
        if (uint8_t(p[x] + bias) > 15)
          fail(std::string(name) + what + " (element " + std::to_string(x) + " is " +
               std::to_string(affine ? int(uint8_t(p[x])) : int(p[x])) + ")");
    }
  }
  // Affine: every scale and min finite, and so every plane's scale and offset on every kernel
  // (the two-plane form's 16 scale, min + 128 scale and 8 scale cover the 8-bit one's).
  const int64_t per = affine ? 2 : 1;
  moe_detail::check_finite_scales(static_cast<const float*>(w.s13), n13 / g * per, "s13");
  moe_detail::check_finite_scales(static_cast<const float*>(w.s2), n2 / g * per, "s2");
  if (affine) {
    const W4Plan plan = w4_plan(w.format, false);
    const char* what_off = bytes ? ": 16 * scale or min + 128 * scale overflows fp32 at group "
                                 : ": min + 8 * scale overflows fp32 at group ";
    for (auto [p, n, name] : {std::tuple{static_cast<const float*>(w.s13), n13 / g, "s13"},
                              std::tuple{static_cast<const float*>(w.s2), n2 / g, "s2"}}) {
      for (int64_t x = 0; x < n; ++x) {
        const float* pair = p + 2 * x;
        bool ok = true;
        for (int plane = 0; plane < plan.planes; ++plane)
          ok = ok && std::isfinite(plan.pair(plane, pair[0], pair[1]).scale) &&
               std::isfinite(plan.offset(plane, pair[0], pair[1]));
        if (!ok)
          fail(std::string(name) + what_off + std::to_string(x) + " (scale " +
               std::to_string(pair[0]) + ", min " + std::to_string(pair[1]) + ")");
      }
    }
  }
  return w;
}

// Bytes of one plane of a packed [n, depth] matrix: the kernel's, rounded up to 64 (each
// plane starts aligned). W4Packer lays the planes out by it; PackedMoeW4::plane_bytes finds them.
size_t w4_plane_bytes(const Q4GemmUkernel& k, int64_t n, int64_t depth, const W4Layout& layout) {
  return moe_detail::align_up(k.rhs_packed_size(n, depth, layout));
}

// One expert's w13 and w2 turned into codes (one per byte) and packed with their group scales,
// as the plan says (W4Plan): the (scale, min) pairs of the affine formats give the kernel its
// scales, their mins are PackedMoeW4's offsets; two planes: each matrix twice, the lo plane
// plane_bytes further.
struct W4Packer final : RhsPacker {
  const Q4GemmUkernel* k;
  const MoeWeightsW4& w;
  W4Plan plan;
  W4Layout layout;  // the kernel's
  W4Packer(const Q4GemmUkernel* kern, const MoeWeightsW4& weights)
      : k(kern), w(weights), plan(w4_plan(weights.format, kern->codes8)),
        layout{plan.kernel, weights.group_size} {}
  bool affine() const { return w4_affine(w.format); }
  // Codes rewritten in scratch: mxfp4's spread, the affine ones' recoded (8-bit codes: as given).
  bool unpacks() const {
    return w.format != W4Format::int4 && plan.kernel != W4Format::int8_affine;
  }
  int planes() const { return plan.planes; }
  void check() const override {
    if (w.w13 == nullptr) fail("w13: missing");
    if (w.w2 == nullptr) fail("w2: missing");
  }
  size_t plane_bytes(int64_t n, int64_t depth) const {
    return w4_plane_bytes(*k, n, depth, layout);
  }
  size_t w13_bytes() const override {
    return size_t(planes()) * plane_bytes(2 * w.intermediate, w.hidden);
  }
  size_t w2_bytes() const override {
    return size_t(planes()) * plane_bytes(w.hidden, w.intermediate);
  }
  // Scratch of one pack_one call: mxfp4's unpacked or the affine formats' shifted codes (one
  // matrix, a few MB), their scales apart from their mins, then the kernel's pack_rhs scratch,
  // each 64-byte aligned.
  size_t one_scratch_bytes(int64_t n, int64_t depth) const {
    using moe_detail::align_up;
    const size_t count = size_t(n) * size_t(depth);
    const size_t codes = unpacks() ? align_up(count) : 0;
    const size_t scales = affine() ? align_up(count / size_t(layout.group) * sizeof(float)) : 0;
    return codes + scales + align_up(k->pack_scratch_bytes(n, depth, layout));
  }
  size_t scratch_bytes() const override {
    return std::max(one_scratch_bytes(2 * w.intermediate, w.hidden),
                    one_scratch_bytes(w.hidden, w.intermediate));
  }
  // Matrix e of [E, n, depth]: codes, then the kernel's packing, per plane. int4 values (int8,
  // two's complement) are their own codes (pack_rhs reads the low 4 bits); mxfp4's two codes
  // per byte are spread one per byte first, into @p scratch (one_scratch_bytes(n, depth) bytes).
  void pack_one(const void* src, const void* scales, int64_t e, int64_t n, int64_t depth,
                void* dst, void* scratch) const {
    const size_t count = size_t(n) * size_t(depth);
    const int64_t groups = depth / layout.group;
    const uint8_t* in = static_cast<const uint8_t*>(src) + size_t(e) * count;
    const size_t in_scale_bytes = size_t(weight_format_scale_bytes(weight_format_of(w.format)));
    const auto* in_sc = static_cast<const uint8_t*>(scales) +
                        size_t(e) * size_t(n) * size_t(groups) * in_scale_bytes;
    for (int plane = 0; plane < planes(); ++plane) {
      auto* ws = static_cast<uint8_t*>(scratch);
      const uint8_t* c = in;
      const uint8_t* sc = in_sc;
      if (unpacks()) {
        uint8_t* codes = ws;
        ws += moe_detail::align_up(count);
        if (w.format == W4Format::mxfp4) {
          const uint8_t* b = static_cast<const uint8_t*>(src) + size_t(e) * count / 2;
          for (size_t x = 0; x < count / 2; ++x) {  // low nibble: the even k
            codes[2 * x] = b[x] & 15;
            codes[2 * x + 1] = b[x] >> 4;
          }
        } else {
          for (size_t x = 0; x < count; ++x) codes[x] = plan.code(plane, c[x]);
        }
        c = codes;
      }
      if (affine()) {  // the plane's scales of the (scale, min) pairs
        auto* only = reinterpret_cast<float*>(ws);
        ws += moe_detail::align_up(size_t(n) * size_t(groups) * sizeof(float));
        const auto* pairs = reinterpret_cast<const float*>(sc);
        for (int64_t x = 0; x < n * groups; ++x)
          only[x] = plan.pair(plane, pairs[2 * x], pairs[2 * x + 1]).scale;
        sc = reinterpret_cast<const uint8_t*>(only);
      }
      k->pack_rhs(n, depth, layout, c, depth, sc, groups,
                  static_cast<uint8_t*>(dst) + size_t(plane) * plane_bytes(n, depth), ws);
    }
  }
  void pack(int64_t e, void* d13, void* d2, void* scratch) const override {
    pack_one(w.w13, w.s13, e, 2 * w.intermediate, w.hidden, d13, scratch);
    pack_one(w.w2, w.s2, e, w.hidden, w.intermediate, d2, scratch);
  }
};

// The affine formats' offsets of one [n, depth] matrix of expert e (pairs [E, n, depth / g, 2])
// in PackedMoeW4's panel layout: panel p (columns [64 p, 64 p + 64)) holds depth / g rows of 64
// offsets, zero past column n; per plane (two: hi, then lo group_offset_floats further).
void fill_offsets(const W4Plan& plan, const float* pairs, int64_t e, int64_t n, int64_t depth,
                  int64_t g, float* out) {
  const int64_t groups = depth / g;
  const float* src = pairs + size_t(e) * size_t(n) * size_t(groups) * 2;
  for (int plane = 0; plane < plan.planes; ++plane) {
    float* base = out + size_t(plane) * group_offset_floats(n, depth, g);
    for (int64_t j0 = 0; j0 < n; j0 += kGroupOffsetPanel) {
      float* panel = base + j0 * groups;
      for (int64_t gi = 0; gi < groups; ++gi)
        for (int64_t jj = 0; jj < kGroupOffsetPanel; ++jj) {
          const int64_t j = j0 + jj;
          const float* sm = src + (j * groups + gi) * 2;
          float o = 0.0f;
          if (j < n) o = plan.offset(plane, sm[0], sm[1]);
          panel[gi * kGroupOffsetPanel + jj] = o;
        }
    }
  }
}

}  // namespace

PackedMoeW4::PackedMoeW4(const MoeWeightsW4& w, const Q4GemmUkernel* kernel, int num_threads)
    : PackedMoeW4(w, w4_config(kernel), num_threads) {}

PackedMoeW4::PackedMoeW4(const MoeWeightsW4& w, const MoeConfig<Q4GemmUkernel>& config,
                         int num_threads)
    : PackedExperts(checked(w).num_experts, w.hidden, w.intermediate, config,
                    W4Packer(config.gemm, w), w.b13, w.b13_dtype, w.b2, w.b2_dtype, num_threads),
      plan_(w4_plan(w.format, config.gemm->codes8)), layout_{plan_.kernel, w.group_size},
      format_(w.format), act_quant_(w.act_quant) {
  if (!w4_affine(format_)) return;
  const int64_t E = w.num_experts, H = w.hidden, I = w.intermediate, g = w.group_size;
  const size_t planes = size_t(plan_.planes);
  o13_stride_ = planes * group_offset_floats(2 * I, H, g);
  o2_stride_ = planes * group_offset_floats(H, I, g);
  const size_t total = size_t(E) * (o13_stride_ + o2_stride_);
  offsets_.reset(new float[total]);
  extra_bytes_ += total * sizeof(float);
  moe_detail::parallel_rows(E, 3 * I * H / g, moe_detail::resolve_threads(num_threads),
                            [&](int64_t e, int) {
    fill_offsets(plan_, static_cast<const float*>(w.s13), e, 2 * I, H, g,
                 offsets_.get() + size_t(e) * o13_stride_);
    fill_offsets(plan_, static_cast<const float*>(w.s2), e, H, I, g,
                 offsets_.get() + size_t(E) * o13_stride_ + size_t(e) * o2_stride_);
  });
  // One plane whose offsets are all zero (GGUF Q8_0: min = -128 scale): none kept, so the op
  // neither reads them nor sums its rows per group. Exact: the term only adds zeros, and the
  // value it adds them to is never -0 (acc * row scale is +0 or nonzero, + bias keeps that).
  if (plan_.planes == 1 &&
      std::all_of(offsets_.get(), offsets_.get() + total, [](float o) { return o == 0.0f; })) {
    offsets_.reset();
    extra_bytes_ -= total * sizeof(float);
    o13_stride_ = o2_stride_ = 0;
  }
}

size_t PackedMoeW4::plane_bytes(int64_t n, int64_t depth) const {
  return w4_plane_bytes(kernel(), n, depth, layout_);
}

PackedMoeBf16::PackedMoeBf16(const MoeWeightsBf16& w, const BGemmUkernel* kernel, int num_threads)
    : PackedMoeBf16(w, bf16_config(kernel), num_threads) {}

PackedMoeBf16::PackedMoeBf16(const MoeWeightsBf16& w, const MoeConfig<BGemmUkernel>& config,
                             int num_threads)
    : PackedExperts(w.num_experts, w.hidden, w.intermediate, config, w.w13, w.w2, w.b13,
                    w.b13_dtype, w.b2, w.b2_dtype, num_threads) {}

namespace {

// The kernels' layout of an fp8 layer: block_k 0 (the whole depth) is one group over both
// depths; 4-bit codes where the kernel takes them (else its packer gets the E4M3 codes).
F8Layout fp8_layout(const MoeWeightsFp8& w, const F8GemmUkernel& kernel) {
  F8Layout l{w.block_k == 0 ? std::max(w.hidden, w.intermediate) : w.block_k, w.block_n};
  if (w.code_bits == 4 && w.codebook != nullptr) {
    std::copy(w.codebook, w.codebook + 16, l.codebook.begin());
    if (kernel.codes4) l.code_bits = 4;
  }
  return l;
}

// The scale rows of one [n, depth] matrix: ceil(n / block_n) rows of f8_groups(depth) scales.
int64_t fp8_scale_count(int64_t n, int64_t depth, const F8Layout& l) {
  return (n + l.block_n - 1) / l.block_n * f8_groups(depth, l);
}

// Checks the FP8 weights' block shape, codes and scales before anything is packed (in the base
// constructor's argument list, as the W4A8 checks).
const MoeWeightsFp8& checked(const MoeWeightsFp8& w) {
  using moe_detail::checked_mul;
  if (w.block_n < 1) fail("block_size: the block's rows (block_n) must be >= 1, got " +
                          std::to_string(w.block_n));
  if (w.block_k < 0) fail("block_size: the block's k extent (block_k) must be >= 0, got " +
                          std::to_string(w.block_k));
  if (w.num_experts < 1 || w.hidden < 1 || w.intermediate < 1) return w;  // the base says why
  for (auto [depth, what] : {std::pair{w.hidden, "H"}, std::pair{w.intermediate, "I"}}) {
    if (w.block_k != 0 && w.block_k % kF8BlockMultiple != 0 && w.block_k < depth)
      fail("block_size: the block's k extent " + std::to_string(w.block_k) + " must be a "
           "multiple of " + std::to_string(kF8BlockMultiple) + " or span the depth (" + what +
           " = " + std::to_string(depth) + ")");
  }
  const int64_t E = w.num_experts, H = w.hidden, I = w.intermediate;
  const int64_t n13 = checked_mul(checked_mul(E, checked_mul(2, I, "w13"), "w13"), H, "w13");
  const int64_t n2 = checked_mul(checked_mul(E, H, "w2"), I, "w2");
  if (w.w13 == nullptr) fail("w13: missing");
  if (w.w2 == nullptr) fail("w2: missing");
  if (w.s13 == nullptr) fail("s13: missing");
  if (w.s2 == nullptr) fail("s2: missing");
  if (w.code_bits != 8 && w.code_bits != 4)
    fail("code_bits: must be 8 (E4M3 codes) or 4 (codebook indices), got " +
         std::to_string(w.code_bits));
  const bool indices = w.code_bits == 4;
  if (indices) {
    if (w.codebook == nullptr) fail("codebook: missing (4-bit codes)");
    bool zero = false;
    for (int i = 0; i < 16; ++i) {
      if ((w.codebook[i] & 0x7F) == 0x7F)
        fail("codebook: E4M3 code " + std::to_string(int(w.codebook[i])) + " is NaN (entry " +
             std::to_string(i) + ")");
      zero = zero || (w.codebook[i] & 0x7F) == 0;
    }
    if (!zero) fail("codebook: needs a zero (+0 or -0) among its 16 codes");
  }
  // A code is bad when NaN (E4M3 0x7F, 0xFF) or, for indices, above 15.
  const auto bad_code = [indices](uint8_t c) { return indices ? c > 15 : (c & 0x7F) == 0x7F; };
  for (auto [p, n, name] : {std::tuple{w.w13, n13, "w13"}, std::tuple{w.w2, n2, "w2"}}) {
    // In chunks without an early exit, as the int4 range check.
    constexpr int64_t kChunk = int64_t(1) << 16;
    for (int64_t x0 = 0; x0 < n; x0 += kChunk) {
      const int64_t x1 = std::min(n, x0 + kChunk);
      uint8_t bad = 0;
      for (int64_t x = x0; x < x1; ++x) bad |= uint8_t(bad_code(p[x]));
      if (bad == 0) continue;
      for (int64_t x = x0; x < x1; ++x)
        if (bad_code(p[x]))
          fail(std::string(name) + (indices ? ": codebook index " : ": E4M3 code ") +
               std::to_string(int(p[x])) + (indices ? " is above 15" : " is NaN") +
               " (element " + std::to_string(x) + ")");
    }
  }
  const F8Layout l{w.block_k == 0 ? std::max(H, I) : w.block_k, w.block_n};
  for (auto [s, count, name] :
       {std::tuple{w.s13, checked_mul(E, fp8_scale_count(2 * I, H, l), "s13"), "s13"},
        std::tuple{w.s2, checked_mul(E, fp8_scale_count(H, I, l), "s2"), "s2"}}) {
    for (int64_t x = 0; x < count; ++x)
      if (!std::isfinite(s[x]) || (!indices && !(s[x] >= 0.0f)))
        fail(std::string(name) + ": every scale must be finite" + (indices ? "" : " and >= 0") +
             " (element " + std::to_string(x) + " is " + std::to_string(s[x]) + ")");
  }
  return w;
}

// One expert's w13 and w2 packed with their block scales by the kernel's pack_rhs; 4-bit codes
// for a kernel without them first become their E4M3 codes (in the call's scratch).
struct Fp8Packer final : RhsPacker {
  const F8GemmUkernel* k;
  const MoeWeightsFp8& w;
  F8Layout layout;
  bool widen;  // indices given, 8-bit codes packed
  Fp8Packer(const F8GemmUkernel* kern, const MoeWeightsFp8& weights)
      : k(kern), w(weights), layout(fp8_layout(weights, *kern)),
        widen(weights.code_bits == 4 && layout.code_bits == 8) {}
  void check() const override {}  // checked() has seen every pointer
  size_t w13_bytes() const override {
    return k->rhs_packed_size(2 * w.intermediate, w.hidden, layout);
  }
  size_t w2_bytes() const override { return k->rhs_packed_size(w.hidden, w.intermediate, layout); }
  size_t scratch_bytes() const override {
    return widen ? size_t(2 * w.intermediate) * size_t(w.hidden) : 0;  // w13's, the larger
  }
  void pack_one(const uint8_t* codes, const float* scales, int64_t e, int64_t n, int64_t depth,
                void* dst, void* scratch) const {
    const int64_t groups = f8_groups(depth, layout);
    const uint8_t* mine = codes + size_t(e) * size_t(n) * size_t(depth);
    if (widen) {
      auto* c = static_cast<uint8_t*>(scratch);
      for (size_t x = 0; x < size_t(n) * size_t(depth); ++x) c[x] = layout.codebook[mine[x]];
      mine = c;
    }
    k->pack_rhs(n, depth, layout, mine, depth,
                scales + size_t(e) * size_t(fp8_scale_count(n, depth, layout)), groups, dst);
  }
  void pack(int64_t e, void* d13, void* d2, void* scratch) const override {
    pack_one(w.w13, w.s13, e, 2 * w.intermediate, w.hidden, d13, scratch);
    pack_one(w.w2, w.s2, e, w.hidden, w.intermediate, d2, scratch);
  }
};

}  // namespace

PackedMoeFp8::PackedMoeFp8(const MoeWeightsFp8& w, const F8GemmUkernel* kernel, int num_threads)
    : PackedMoeFp8(w, fp8_config(kernel), num_threads) {}

PackedMoeFp8::PackedMoeFp8(const MoeWeightsFp8& w, const MoeConfig<F8GemmUkernel>& config,
                           int num_threads)
    : PackedExperts(checked(w).num_experts, w.hidden, w.intermediate, config,
                    Fp8Packer(config.gemm, w), w.b13, w.b13_dtype, w.b2, w.b2_dtype, num_threads),
      layout_(fp8_layout(w, *config.gemm)),
      block_k_(w.block_k) {}

}  // namespace cpumoe
