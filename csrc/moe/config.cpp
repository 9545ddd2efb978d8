// The per-family config builders (moe.h): the whole chain of a layer, chosen once at prepack.
#include "cpumoe/moe.h"

namespace cpumoe {
namespace {

template <class Kernel>
MoeConfig<Kernel> config_for(const Kernel* kernel) {
  MoeConfig<Kernel> cfg;
  cfg.gemm = kernel;
  cfg.rowops = rowops_for(kernel->isa);  // a cap on the kernel caps the row operations too
  return cfg;
}

}  // namespace

MoeConfig<QGemmUkernel> int8_config(const QGemmUkernel* kernel, const Isa* cap) {
  return config_for(kernel != nullptr ? kernel : qgemm_select(cap));
}

MoeConfig<Q4GemmUkernel> w4_config(const Q4GemmUkernel* kernel, const Isa* cap) {
  return config_for(kernel != nullptr ? kernel : q4gemm_select(cap));
}

MoeConfig<F8GemmUkernel> fp8_config(const F8GemmUkernel* kernel, const Isa* cap) {
  return config_for(kernel != nullptr ? kernel : f8gemm_select(cap));
}

MoeConfig<BGemmUkernel> bf16_config(const BGemmUkernel* kernel, const Isa* cap) {
  return config_for(kernel != nullptr ? kernel : bgemm_select(cap));
}

}  // namespace cpumoe
