// cpumoe_f8gemm_avx512emu_test: test_f8gemm.cpp's kernel tests (F8GemmKernelTest) on the AVX-512
// f8gemm kernel built over SIMDe (f8gemm_avx512_simde.cpp), so CPUs without AVX-512 check its
// logic too. test_f8gemm.cpp is compiled in whole and this file adds one instantiation of its
// parameterized suite; the rest of it (the registry's kernels and rules) is cpumoe_f8gemm_test's
// job, so without a --gtest_filter this binary runs and lists (for ctest's discovery) only the
// Avx512Emu tests.
#include "test_f8gemm.cpp"

#include "avx512emu/f8gemm_avx512_emu.h"

namespace {

INSTANTIATE_TEST_SUITE_P(Avx512Emu, F8GemmKernelTest,
                         testing::Values(&cpumoe_test::f8gemm_avx512_vnni_simde), KernelName);

}  // namespace

// This binary's own main (gtest_main's is then not linked in): the default filter narrowed to the
// emulated kernel's tests after InitGoogleTest has read the arguments.
int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  if (GTEST_FLAG_GET(filter) == "*") GTEST_FLAG_SET(filter, "Avx512Emu/*");
  return RUN_ALL_TESTS();
}
