// The public ops of moe.h: validate, then run the pipeline (pipeline.h) chunk by chunk over the
// chain chosen at prepack; the scratch bounds from the planner (plan.h). Tokens are processed in
// chunks of at most kSlotsPerChunk slots, so scratch memory is bounded for any batch.
//
// Sizes and offsets are int64_t / size_t throughout (T * k * H exceeds 2^31 at real shapes).
#include "cpumoe/moe.h"

#include <algorithm>
#include <string>

#include "parallel.h"
#include "pipeline.h"
#include "plan.h"
#include "validate.h"

namespace cpumoe {
namespace {

using namespace moe_detail;

template <class Packed>
void run_op(const Packed& packed, const MoeCall& call) {
  using Kernel = std::decay_t<decltype(packed.kernel())>;
  validate(call, packed.num_experts(), packed.hidden());
  if (call.num_tokens == 0) return;
  const int threads = resolve_threads(call.num_threads);
  const int64_t per_chunk = tokens_per_chunk(call.topk);
  for (int64_t t0 = 0; t0 < call.num_tokens; t0 += per_chunk) {
    Pipeline<Kernel> chunk(packed, call, threads, t0, std::min(per_chunk, call.num_tokens - t0));
    chunk.run();
  }
}

// pk: the packed layer (its layout bounds the W4 kernels' scratch), or nullptr for a bound over
// every layer of these sizes that cfg's kernel packs.
template <class Kernel>
size_t scratch_bound(const MoeConfig<Kernel>& cfg, const typename Family<Kernel>::Packed* pk,
                     int64_t num_experts, int64_t hidden, int64_t intermediate,
                     int64_t num_tokens, int64_t topk, int num_threads) {
  if (num_experts < 1 || hidden < 1 || intermediate < 1)
    fail("packed: E, H and I must be >= 1");
  if (num_tokens < 0) fail("num_tokens: must be >= 0");
  if (topk < 1) fail("topk: must be >= 1, got " + std::to_string(topk));
  if (num_tokens == 0) return 0;
  const int64_t tc = std::min(num_tokens, tokens_per_chunk(topk));
  const int64_t elem = sizeof(typename Family<Kernel>::Elem);
  const size_t kscratch = Family<Kernel>::kernel_scratch(
      *cfg.gemm, pk, max_call_rows(cfg.tiles, cfg.gemm->mr, tc, topk), hidden, intermediate);
  ChunkSizes s = worst_case(cfg, elem, num_experts, hidden, intermediate, tc, topk,
                            resolve_threads(num_threads), kscratch);
  s.groups1 = Family<Kernel>::groups(pk, hidden);
  s.groups2 = Family<Kernel>::groups(pk, intermediate);
  s.agroups1 = Family<Kernel>::act_groups(pk, hidden);
  s.agroups2 = Family<Kernel>::act_groups(pk, intermediate);
  size_t bound = plan(s).total;
  if (cfg.tiles.fuse_gemm1 && cfg.tiles.fuse_gemm2) {
    // A call with fewer slots may lay y out apart (at most kFusedGemm2MaxY bytes) after the
    // buffers of phases 1-5, which are largest at the worst case's slots.
    s.y_apart = std::min(kFusedGemm2MaxY, size_t(checked_mul(checked_mul(s.P, hidden, "scratch"),
                                                             4, "scratch")));
    bound = std::max(bound, plan(s).total);
  }
  return bound;
}

template <class Packed>
size_t packed_bound(const Packed& packed, int64_t num_tokens, int64_t topk, int num_threads) {
  return scratch_bound(packed.config(), &packed, packed.num_experts(), packed.hidden(),
                       packed.intermediate(), num_tokens, topk, num_threads);
}

}  // namespace

float quantize_row(const void* x, DType dt, int64_t n, int8_t* q) {
  return rowops_registry().back()->quantize(x, dt, n, q);  // rowops_portable: the baseline
}

void fused_moe_int8(const PackedMoe& packed, const MoeCall& call) { run_op(packed, call); }

void fused_moe_int8(const PackedMoeW4& packed, const MoeCall& call) { run_op(packed, call); }

void fused_moe_bf16(const PackedMoeBf16& packed, const MoeCall& call) { run_op(packed, call); }

void fused_moe_bf16(const PackedMoeFp8& packed, const MoeCall& call) { run_op(packed, call); }

size_t fused_moe_scratch_bytes(const QGemmUkernel& kernel, int64_t num_experts, int64_t hidden,
                               int64_t intermediate, int64_t num_tokens, int64_t topk,
                               int num_threads) {
  return scratch_bound(int8_config(&kernel), nullptr, num_experts, hidden, intermediate, num_tokens,
                       topk, num_threads);
}

size_t fused_moe_scratch_bytes(const BGemmUkernel& kernel, int64_t num_experts, int64_t hidden,
                               int64_t intermediate, int64_t num_tokens, int64_t topk,
                               int num_threads) {
  return scratch_bound(bf16_config(&kernel), nullptr, num_experts, hidden, intermediate, num_tokens,
                       topk, num_threads);
}

size_t fused_moe_scratch_bytes(const PackedMoe& packed, int64_t num_tokens, int64_t topk,
                               int num_threads) {
  return packed_bound(packed, num_tokens, topk, num_threads);
}

size_t fused_moe_scratch_bytes(const Q4GemmUkernel& kernel, int64_t num_experts, int64_t hidden,
                               int64_t intermediate, int64_t num_tokens, int64_t topk,
                               int num_threads) {
  return scratch_bound(w4_config(&kernel), nullptr, num_experts, hidden, intermediate, num_tokens,
                       topk, num_threads);
}

size_t fused_moe_scratch_bytes(const PackedMoeW4& packed, int64_t num_tokens, int64_t topk,
                               int num_threads) {
  return packed_bound(packed, num_tokens, topk, num_threads);
}

size_t fused_moe_scratch_bytes(const PackedMoeBf16& packed, int64_t num_tokens, int64_t topk,
                               int num_threads) {
  return packed_bound(packed, num_tokens, topk, num_threads);
}

size_t fused_moe_scratch_bytes(const F8GemmUkernel& kernel, int64_t num_experts, int64_t hidden,
                               int64_t intermediate, int64_t num_tokens, int64_t topk,
                               int num_threads) {
  return scratch_bound(fp8_config(&kernel), nullptr, num_experts, hidden, intermediate, num_tokens,
                       topk, num_threads);
}

size_t fused_moe_scratch_bytes(const PackedMoeFp8& packed, int64_t num_tokens, int64_t topk,
                               int num_threads) {
  return packed_bound(packed, num_tokens, topk, num_threads);
}

}  // namespace cpumoe
