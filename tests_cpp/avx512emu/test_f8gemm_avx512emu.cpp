// cpumoe_f8gemm_avx512emu_test: test_f8gemm.cpp's kernel tests (F8GemmKernelTest) on the AVX-512
// f8gemm kernels built over SIMDe (f8gemm_avx512_simde.cpp, f8gemm_avx512_bf16_simde.cpp), so CPUs without AVX-512 check its
// logic too. test_f8gemm.cpp is compiled in whole and this file adds one instantiation of its
// parameterized suite; the rest of it (the registry's kernels and rules) is cpumoe_f8gemm_test's
// job, so without a --gtest_filter this binary runs and lists (for ctest's discovery) only the
// Avx512Emu tests.
#include "test_f8gemm.cpp"

#include "avx512emu/f8gemm_avx512_emu.h"

namespace {

INSTANTIATE_TEST_SUITE_P(Avx512Emu, F8GemmKernelTest,
                         testing::Values(&cpumoe_test::f8gemm_avx512_vnni_simde,
                                         &cpumoe_test::f8gemm_avx512_bf16_simde),
                         KernelName);

// The emulation is only worth its tests if it computes what the hardware does: where this CPU
// has the kernel's ISA, the registry's kernel and its SIMDe build give the same bits on random
// reals (rounding order, flushing and the decode all show in them), m across the register path
// and the expand-once panels.
TEST(Avx512Emu, SameBitsAsTheHardwareKernel) {
  bool ran = false;
  for (const cpumoe::F8GemmUkernel* emu :
       {&cpumoe_test::f8gemm_avx512_vnni_simde, &cpumoe_test::f8gemm_avx512_bf16_simde}) {
    const std::string real_name = std::string(emu->name).substr(0, std::strlen(emu->name) - 6);
    const cpumoe::F8GemmUkernel* real = nullptr;
    for (const cpumoe::F8GemmUkernel* c : cpumoe::f8gemm_registry())
      if (real_name == c->name) real = c;
    if (real == nullptr || !cpumoe::cpu_supports(real->isa)) continue;
    ran = true;
    std::mt19937 rng(7);
    for (int64_t m : {1, 5, 8, 13, 30})
      for (int64_t group : {32, 128}) {
        const int64_t n = 70, k = 300;
        SCOPED_TRACE(testing::Message() << real->name << " m=" << m << " group=" << group);
        cpumoe::F8Layout w;
        w.group = group;
        w.block_n = 16;
        const int64_t groups = cpumoe::f8_groups(k, w), blocks = (n + w.block_n - 1) / w.block_n;
        std::vector<uint16_t> a(size_t(m * k));
        for (auto& v : a) v = uint16_t(0x3C00 + rng() % 0x800) | uint16_t(rng() % 2 ? 0x8000 : 0);
        std::vector<const uint16_t*> rows;
        for (int64_t i = 0; i < m; ++i) rows.push_back(a.data() + i * k);
        std::vector<uint8_t> codes(size_t(n * k));
        for (auto& c : codes) {
          c = uint8_t(rng());
          if ((c & 0x7F) == 0x7F) c = 0;  // no NaN codes
        }
        std::vector<float> scales(size_t(blocks * groups));
        for (auto& s : scales) s = float(rng() % 1000 + 1) / 512.0f;
        const auto run = [&](const cpumoe::F8GemmUkernel& kern) {
          std::vector<uint8_t> lhs(kern.lhs_packed_size(m, k) + 64), rhs(kern.rhs_packed_size(n, k, w) + 64);
          uint8_t* lp = lhs.data() + (64 - reinterpret_cast<uintptr_t>(lhs.data()) % 64) % 64;
          uint8_t* rp = rhs.data() + (64 - reinterpret_cast<uintptr_t>(rhs.data()) % 64) % 64;
          kern.pack_lhs(m, k, rows.data(), lp);
          kern.pack_rhs(n, k, w, codes.data(), k, scales.data(), groups, rp);
          std::vector<uint8_t> scratch(kern.scratch_bytes(m, n, k, w) + 64);
          cpumoe::F8GemmEpilogue ep;
          ep.scratch = scratch.data() + (64 - reinterpret_cast<uintptr_t>(scratch.data()) % 64) % 64;
          std::vector<float> out(size_t(m * n), -1.0f);
          kern.run_f32(m, n, k, w, lp, rp, out.data(), n, ep);
          return out;
        };
        const std::vector<float> want = run(*real), got = run(*emu);
        ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * 4), 0);
      }
  }
  if (!ran) GTEST_SKIP() << "this CPU runs none of the emulated kernels natively";
}

}  // namespace

// This binary's own main (gtest_main's is then not linked in): the default filter narrowed to the
// emulated kernel's tests after InitGoogleTest has read the arguments.
int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  if (GTEST_FLAG_GET(filter) == "*") GTEST_FLAG_SET(filter, "Avx512Emu/*:Avx512Emu.*");
  return RUN_ALL_TESTS();
}
