// The qgemm (int8) and bgemm (bf16) registries: every variant this build compiled, best first.
// Adding an ISA is one kernel file, one source-list entry in CMake and one line here. Built
// without ISA flags.
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpumoe/bgemm.h"
#include "cpumoe/qgemm.h"
#include "cpumoe/rowops.h"

namespace cpumoe {

#define CPUMOE_DECLARE_QGEMM(name) extern const QGemmUkernel name;
#if defined(CPUMOE_HAVE_I8MM)
CPUMOE_DECLARE_QGEMM(qgemm_qs8p8x8_qs8cp8x8_8x8_neon_i8mm)
#endif
#if defined(CPUMOE_HAVE_BF16)
CPUMOE_DECLARE_QGEMM(qgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16)
#endif
#if defined(CPUMOE_HAVE_DOTPROD)
CPUMOE_DECLARE_QGEMM(qgemm_qs8r_qs8ci8x4_8x8_neon_dotprod)
#endif
#if defined(CPUMOE_HAVE_AMX)
CPUMOE_DECLARE_QGEMM(qgemm_qu8r_qs8ci16x4s_16x16_amx)
#endif
#if defined(CPUMOE_HAVE_AVX512VNNI)
CPUMOE_DECLARE_QGEMM(qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni)
#endif
#if defined(CPUMOE_HAVE_AVX2)
CPUMOE_DECLARE_QGEMM(qgemm_qs16r_qs8ci8x2_4x8_avx2)
#endif
CPUMOE_DECLARE_QGEMM(qgemm_qs8r_qs8cr4_1x4_portable)

const std::vector<const QGemmUkernel*>& qgemm_registry() {
  static const std::vector<const QGemmUkernel*> all = {
#if defined(CPUMOE_HAVE_I8MM)
      &qgemm_qs8p8x8_qs8cp8x8_8x8_neon_i8mm,
#endif
#if defined(CPUMOE_HAVE_BF16)
      &qgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16,
#endif
#if defined(CPUMOE_HAVE_DOTPROD)
      &qgemm_qs8r_qs8ci8x4_8x8_neon_dotprod,
#endif
#if defined(CPUMOE_HAVE_AMX)
      &qgemm_qu8r_qs8ci16x4s_16x16_amx,
#endif
#if defined(CPUMOE_HAVE_AVX512VNNI)
      &qgemm_qu8r_qs8ci16x4s_8x16_avx512_vnni,
#endif
#if defined(CPUMOE_HAVE_AVX2)
      &qgemm_qs16r_qs8ci8x2_4x8_avx2,
#endif
      &qgemm_qs8r_qs8cr4_1x4_portable,
  };
  return all;
}

namespace {

// The first kernel of a registry (best first) this CPU runs within both caps.
template <class Kernel>
const Kernel* select_from(const std::vector<const Kernel*>& registry, const Isa* cap) {
  const Isa* env = env_isa_cap();
  for (const Kernel* k : registry) {
    if (cap != nullptr && int(k->isa) > int(*cap)) continue;
    if (env != nullptr && int(k->isa) > int(*env)) continue;
    if (cpu_supports(k->isa)) return k;
  }
  // The portable kernel is always compiled in and always supported.
  throw std::logic_error("cpumoe: no portable kernel registered (build is broken)");
}

template <class Kernel>
const Kernel* find_in(const std::vector<const Kernel*>& registry, const char* name) {
  for (const Kernel* k : registry)
    if (std::strcmp(k->name, name) == 0) return k;
  return nullptr;
}

}  // namespace

const QGemmUkernel* qgemm_select(const Isa* cap) { return select_from(qgemm_registry(), cap); }
const QGemmUkernel* qgemm_find(const char* name) { return find_in(qgemm_registry(), name); }

#define CPUMOE_DECLARE_BGEMM(name) extern const BGemmUkernel name;
#if defined(CPUMOE_HAVE_AVX512BF16)
CPUMOE_DECLARE_BGEMM(bgemm_bf16r_bf16ci16x2_8x16_avx512_bf16)
#endif
#if defined(CPUMOE_HAVE_AVX2)
CPUMOE_DECLARE_BGEMM(bgemm_f32r_bf16ci8x2_6x8_avx2)
#endif
#if defined(CPUMOE_HAVE_BF16)
CPUMOE_DECLARE_BGEMM(bgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16)
#endif
CPUMOE_DECLARE_BGEMM(bgemm_f32r_bf16ck8_4x8_portable)

const std::vector<const BGemmUkernel*>& bgemm_registry() {
  static const std::vector<const BGemmUkernel*> all = {
#if defined(CPUMOE_HAVE_AVX512BF16)
      &bgemm_bf16r_bf16ci16x2_8x16_avx512_bf16,
#endif
#if defined(CPUMOE_HAVE_AVX2)
      &bgemm_f32r_bf16ci8x2_6x8_avx2,
#endif
#if defined(CPUMOE_HAVE_BF16)
      &bgemm_bf16p2x4_bf16cp8x4_8x8_neon_bf16,
#endif
      &bgemm_f32r_bf16ck8_4x8_portable,
  };
  return all;
}

const BGemmUkernel* bgemm_select(const Isa* cap) { return select_from(bgemm_registry(), cap); }
const BGemmUkernel* bgemm_find(const char* name) { return find_in(bgemm_registry(), name); }

#if defined(CPUMOE_HAVE_BF16)
extern const RowOps rowops_neon_bf16;
#endif
#if defined(CPUMOE_HAVE_AVX512VNNI)
extern const RowOps rowops_avx512;
#endif
#if defined(CPUMOE_HAVE_AVX2)
extern const RowOps rowops_avx2;
#endif
extern const RowOps rowops_portable;

const std::vector<const RowOps*>& rowops_registry() {
  static const std::vector<const RowOps*> all = {
#if defined(CPUMOE_HAVE_BF16)
      &rowops_neon_bf16,
#endif
#if defined(CPUMOE_HAVE_AVX512VNNI)
      &rowops_avx512,
#endif
#if defined(CPUMOE_HAVE_AVX2)
      &rowops_avx2,
#endif
      &rowops_portable,
  };
  return all;
}

const RowOps* rowops_for(Isa kernel_isa) { return select_from(rowops_registry(), &kernel_isa); }
const RowOps* rowops_find(const char* name) { return find_in(rowops_registry(), name); }

}  // namespace cpumoe
