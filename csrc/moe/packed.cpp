// The packed layers (moe.h): PackedExperts packs both families' weights for the kernel of the
// layer's config; PackedMoe adds the int8 scales.
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

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

template <class Kernel>
template <class Elem>
PackedExperts<Kernel>::PackedExperts(int64_t e, int64_t h, int64_t i,
                                     const MoeConfig<Kernel>& config, const Elem* w13,
                                     const Elem* w2, const void* b13, DType b13_dtype,
                                     const void* b2, DType b2_dtype, int num_threads)
    : e_(e), h_(h), i_(i), config_(config) {
  if (config_.gemm == nullptr || config_.rowops == nullptr)
    fail("config: kernel and row operations must be set (use int8_config / bf16_config)");
  if (e_ < 1) fail("w13: number of experts must be >= 1");
  check_dim(h_, "w13: hidden size H");
  check_dim(i_, "w2: intermediate size I");
  // The element counts of w13 [E, 2I, H] and w2 [E, H, I] (and so every smaller product below)
  // fit int64_t: absurd sizes from a malformed checkpoint are an error, not a wrapped size.
  moe_detail::checked_mul(moe_detail::checked_mul(e_, moe_detail::checked_mul(2, i_, "w13"), "w13"), h_,
                          "w13");
  moe_detail::checked_mul(moe_detail::checked_mul(e_, h_, "w2"), i_, "w2");
  if (w13 == nullptr) fail("w13: missing");
  if (w2 == nullptr) fail("w2: missing");
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
  w13_stride_ = moe_detail::align_up(k.rhs_packed_size(2 * i_, h_));
  w2_stride_ = moe_detail::align_up(k.rhs_packed_size(h_, i_));
  w13_.reset(static_cast<uint8_t*>(moe_detail::alloc_large(checked_bytes(w13_stride_, e_, "w13"))));
  w2_.reset(static_cast<uint8_t*>(moe_detail::alloc_large(checked_bytes(w2_stride_, e_, "w2"))));
  if (!w13_ || !w2_) throw std::bad_alloc();
  moe_detail::parallel_for(e_, threads, [&](int64_t x, int) {
    k.pack_rhs(2 * i_, h_, w13 + x * 2 * i_ * h_, h_, w13_.get() + size_t(x) * w13_stride_);
    k.pack_rhs(h_, i_, w2 + x * h_ * i_, i_, w2_.get() + size_t(x) * w2_stride_);
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

PackedMoeBf16::PackedMoeBf16(const MoeWeightsBf16& w, const BGemmUkernel* kernel, int num_threads)
    : PackedMoeBf16(w, bf16_config(kernel), num_threads) {}

PackedMoeBf16::PackedMoeBf16(const MoeWeightsBf16& w, const MoeConfig<BGemmUkernel>& config,
                             int num_threads)
    : PackedExperts(w.num_experts, w.hidden, w.intermediate, config, w.w13, w.w2, w.b13,
                    w.b13_dtype, w.b2, w.b2_dtype, num_threads) {}

}  // namespace cpumoe
