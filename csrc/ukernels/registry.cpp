// The qgemm (int8), q4gemm (W4A8), bgemm (bf16), f8gemm (W8A16 FP8) and row-operation
// registries: every variant this build compiled, best first. The list comes from the build
// (cpumoe_kernels.inc, one CPUMOE_KERNEL(family, symbol) line per cpumoe_add_kernel in
// csrc/CMakeLists.txt), so nothing here names a kernel or an ISA.
// Built without ISA flags.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpumoe/bgemm.h"
#include "cpumoe/f8gemm.h"
#include "cpumoe/q4gemm.h"
#include "cpumoe/qgemm.h"
#include "cpumoe/rowops.h"

namespace cpumoe {

// The interface struct of each family, by the family's name in CMake.
using qgemm_ukernel = QGemmUkernel;
using q4gemm_ukernel = Q4GemmUkernel;
using bgemm_ukernel = BGemmUkernel;
using f8gemm_ukernel = F8GemmUkernel;
using rowops_ukernel = RowOps;

#define CPUMOE_KERNEL(family, symbol) extern const family##_ukernel symbol;
#include "ukernels/cpumoe_kernels.inc"
#undef CPUMOE_KERNEL

namespace {

// The kernels of one family (interface struct Kernel) best first: by level, highest first; ties
// keep the CMake line order. The other families' kernels go to the template add(), which drops them.
template <class Kernel>
struct Collect {
  std::vector<const Kernel*> all;
  void add(const Kernel& k) { all.push_back(&k); }
  template <class Other>
  void add(const Other&) {}
};

template <class Kernel>
std::vector<const Kernel*> best_first() {
  Collect<Kernel> c;
#define CPUMOE_KERNEL(family, symbol) c.add(symbol);
#include "ukernels/cpumoe_kernels.inc"
#undef CPUMOE_KERNEL
  std::stable_sort(c.all.begin(), c.all.end(),
                   [](const Kernel* a, const Kernel* b) { return int(a->isa) > int(b->isa); });
  return c.all;
}

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

const std::vector<const QGemmUkernel*>& qgemm_registry() {
  static const std::vector<const QGemmUkernel*> all = best_first<QGemmUkernel>();
  return all;
}

const std::vector<const Q4GemmUkernel*>& q4gemm_registry() {
  static const std::vector<const Q4GemmUkernel*> all = best_first<Q4GemmUkernel>();
  return all;
}

const std::vector<const BGemmUkernel*>& bgemm_registry() {
  static const std::vector<const BGemmUkernel*> all = best_first<BGemmUkernel>();
  return all;
}

const std::vector<const F8GemmUkernel*>& f8gemm_registry() {
  static const std::vector<const F8GemmUkernel*> all = best_first<F8GemmUkernel>();
  return all;
}

const std::vector<const RowOps*>& rowops_registry() {
  static const std::vector<const RowOps*> all = best_first<RowOps>();
  return all;
}

const QGemmUkernel* qgemm_select(const Isa* cap) { return select_from(qgemm_registry(), cap); }
const QGemmUkernel* qgemm_find(const char* name) { return find_in(qgemm_registry(), name); }

const Q4GemmUkernel* q4gemm_select(const Isa* cap) { return select_from(q4gemm_registry(), cap); }
const Q4GemmUkernel* q4gemm_find(const char* name) { return find_in(q4gemm_registry(), name); }

const BGemmUkernel* bgemm_select(const Isa* cap) { return select_from(bgemm_registry(), cap); }
const BGemmUkernel* bgemm_find(const char* name) { return find_in(bgemm_registry(), name); }

const F8GemmUkernel* f8gemm_select(const Isa* cap) { return select_from(f8gemm_registry(), cap); }
const F8GemmUkernel* f8gemm_find(const char* name) { return find_in(f8gemm_registry(), name); }

const RowOps* rowops_for(Isa kernel_isa) { return select_from(rowops_registry(), &kernel_isa); }
const RowOps* rowops_find(const char* name) { return find_in(rowops_registry(), name); }

}  // namespace cpumoe
