// CPU features and kernel choice. The key property: the same binary runs on a CPU without I8MM
// (qemu -cpu neoverse-n1 / cortex-a57), choosing a kernel it supports and never executing one it
// does not.
#include <gtest/gtest.h>

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cpumoe/cpu_features.h"
#include "cpumoe/probes.h"
#include "cpumoe/moe.h"
#include "cpumoe/qgemm.h"
#include "moe_test_util.h"

namespace {

using cpumoe::Isa;
using cpumoe::QGemmUkernel;

// The cap from CPUMOE_ISA, if the environment sets one (the suite also runs with it set).
bool within_env_cap(Isa isa) {
  const Isa* cap = cpumoe::env_isa_cap();
  return cap == nullptr || int(isa) <= int(*cap);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

TEST(Dispatch, RegistryIsNonEmptyBestFirstPortableLast) {
  const auto& reg = cpumoe::qgemm_registry();
  ASSERT_FALSE(reg.empty());
  EXPECT_EQ(reg.back()->isa, Isa::portable);
  for (size_t i = 0; i + 1 < reg.size(); ++i) {
    EXPECT_GT(int(reg[i]->isa), int(reg[i + 1]->isa)) << reg[i]->name << " before " << reg[i + 1]->name;
    EXPECT_NE(reg[i]->isa, Isa::portable) << "only the last kernel may be portable";
  }
}

TEST(Dispatch, KernelNamesFollowTheGrammarAndAreUnique) {
  std::set<std::string> names;
  const std::vector<Isa> ladder = cpumoe::isa_ladder();
  for (const QGemmUkernel* k : cpumoe::qgemm_registry()) {
    const std::string name = k->name;
    EXPECT_TRUE(names.insert(name).second) << "duplicate " << name;
    EXPECT_EQ(name.rfind("qgemm_", 0), 0u) << name;
    EXPECT_TRUE(ends_with(name, std::string("_") + cpumoe::isa_name(k->isa))) << name;
    const std::string tile = "_" + std::to_string(k->mr) + "x" + std::to_string(k->nr) + "_";
    EXPECT_NE(name.find(tile), std::string::npos) << name << " lacks its tile " << tile;
    EXPECT_NE(std::find(ladder.begin(), ladder.end(), k->isa), ladder.end())
        << name << ": ISA not on this architecture's ladder";
    EXPECT_EQ(cpumoe::qgemm_find(k->name), k);
  }
  EXPECT_EQ(cpumoe::qgemm_find("qgemm_no_such_kernel"), nullptr);
}

TEST(Dispatch, IsaLadderAndNames) {
  const std::vector<Isa> ladder = cpumoe::isa_ladder();
  ASSERT_FALSE(ladder.empty());
  EXPECT_EQ(ladder.back(), Isa::portable);
  for (size_t i = 0; i + 1 < ladder.size(); ++i) EXPECT_GT(int(ladder[i]), int(ladder[i + 1]));
  for (Isa isa : ladder) EXPECT_EQ(cpumoe::parse_isa(cpumoe::isa_name(isa), "test"), isa);
  try {
    cpumoe::parse_isa("no_such_isa", "CPUMOE_ISA");
    ADD_FAILURE() << "parse_isa accepted a bogus name";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("CPUMOE_ISA"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("portable"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(cpumoe::cpu_supports(Isa::portable));
#if defined(__aarch64__)
  EXPECT_STREQ(cpumoe::target_arch(), "aarch64");
  EXPECT_TRUE(cpumoe::cpu_features().neon);
#elif defined(__x86_64__)
  EXPECT_STREQ(cpumoe::target_arch(), "x86_64");
#endif
}

// The levels' numbers, names and ladders are API (isa= arguments, CPUMOE_ISA, the Python
// features): generating them from isa_table.def must keep them exactly.
TEST(Dispatch, IsaTableKeepsTheApi) {
  const std::pair<Isa, int> values[] = {
      {Isa::portable, 0},     {Isa::neon, 9},          {Isa::neon_dotprod, 10},
      {Isa::neon_bf16, 11},   {Isa::neon_i8mm, 12},    {Isa::avx2, 20},
      {Isa::avx512_vnni, 21}, {Isa::avx512_bf16, 22},  {Isa::amx, 23}};
  const char* names[] = {"portable", "neon", "neon_dotprod", "neon_bf16", "neon_i8mm",
                         "avx2", "avx512_vnni", "avx512_bf16", "amx"};
  for (size_t i = 0; i < 9; ++i) {
    EXPECT_EQ(int(values[i].first), values[i].second);
    EXPECT_STREQ(cpumoe::isa_name(values[i].first), names[i]);
  }
  EXPECT_STREQ(cpumoe::isa_name(Isa(99)), "?");
#if defined(__aarch64__)
  const std::vector<Isa> want{Isa::neon_i8mm, Isa::neon_bf16, Isa::neon_dotprod, Isa::neon,
                              Isa::portable};
#elif defined(__x86_64__)
  const std::vector<Isa> want{Isa::amx, Isa::avx512_bf16, Isa::avx512_vnni, Isa::avx2,
                              Isa::portable};
#else
  const std::vector<Isa> want{Isa::portable};
#endif
  EXPECT_EQ(cpumoe::isa_ladder(), want);
  // A level needs the one it requires: avx512_bf16 needs avx512_vnni, amx needs avx512_bf16.
  for (Isa isa : {Isa::avx512_bf16, Isa::amx}) {
    EXPECT_TRUE(!cpumoe::cpu_has(isa) || cpumoe::cpu_has(Isa::avx512_vnni)) << cpumoe::isa_name(isa);
    EXPECT_TRUE(!cpumoe::cpu_supports(isa) || cpumoe::cpu_has(isa)) << cpumoe::isa_name(isa);
  }
  EXPECT_TRUE(!cpumoe::cpu_has(Isa::amx) || cpumoe::cpu_has(Isa::avx512_bf16));
}

#if defined(__x86_64__) && defined(__linux__)
// The AMX tile-state permission is asked for when an AMX kernel is first chosen, never by the
// yes/no queries (ctest runs each test in a process of its own, so this one starts without it).
// ARCH_GET_XCOMP_PERM (0x1022) reports the permitted features; bit 18 is the tile data.
TEST(Dispatch, AmxPermissionAskedOnlyWhenAnAmxKernelIsChosen) {
  if (!cpumoe::cpu_has(Isa::amx)) GTEST_SKIP() << "this CPU has no AMX";
  const auto permitted = [] {
    uint64_t mask = 0;
    EXPECT_EQ(syscall(SYS_arch_prctl, 0x1022, &mask), 0);
    return (mask >> 18) & 1;
  };
  if (permitted()) GTEST_SKIP() << "the process already had the permission when the test began";
  // Every query: features, levels, registries, the listing the bindings make.
  (void)cpumoe::cpu_features();
  for (Isa isa : cpumoe::isa_ladder()) (void)cpumoe::cpu_has(isa);
  (void)cpumoe::qgemm_registry();
  (void)cpumoe::bgemm_registry();
  EXPECT_EQ(permitted(), 0u) << "a yes/no query asked Linux for the AMX tile state";
  // Choosing the AMX kernel asks (once).
  const Isa amx = Isa::amx;
  const QGemmUkernel* k = cpumoe::qgemm_select(&amx);
  if (within_env_cap(Isa::amx)) {
    EXPECT_EQ(k->isa, Isa::amx);
    EXPECT_EQ(permitted(), 1u);
  }
}
#endif

TEST(Dispatch, SelectReturnsTheBestSupportedKernel) {
  const QGemmUkernel* sel = cpumoe::qgemm_select();
  ASSERT_NE(sel, nullptr);
  EXPECT_TRUE(cpumoe::cpu_supports(sel->isa));
  const QGemmUkernel* want = nullptr;
  for (const QGemmUkernel* k : cpumoe::qgemm_registry())
    if (cpumoe::cpu_supports(k->isa) && within_env_cap(k->isa)) {
      want = k;
      break;
    }
  EXPECT_EQ(sel, want);
  RecordProperty("selected_kernel", sel->name);
  std::cout << "[ selected ] " << sel->name << " (isa " << cpumoe::isa_name(sel->isa) << ", "
            << sel->mr << "x" << sel->nr << ", kr " << sel->kr << ")" << std::endl;
}

TEST(Dispatch, SelectHonoursACap) {
  for (Isa cap : cpumoe::isa_ladder()) {
    const QGemmUkernel* k = cpumoe::qgemm_select(&cap);
    ASSERT_NE(k, nullptr);
    EXPECT_LE(int(k->isa), int(cap)) << cpumoe::isa_name(cap);
    EXPECT_TRUE(cpumoe::cpu_supports(k->isa));
    EXPECT_TRUE(within_env_cap(k->isa));
  }
  const Isa portable = Isa::portable;
  EXPECT_EQ(cpumoe::qgemm_select(&portable)->isa, Isa::portable);
}

// Runs in the discovered suite (usually without CPUMOE_ISA) and once more as
// cpumoe_qgemm_test.EnvIsaCapPortable with CPUMOE_ISA=portable (see CMakeLists.txt).
TEST(Dispatch, EnvIsaCap) {
  const char* env = std::getenv("CPUMOE_ISA");
  if (env == nullptr || *env == '\0') {
    EXPECT_EQ(cpumoe::env_isa_cap(), nullptr);
    return;
  }
  const Isa* cap = cpumoe::env_isa_cap();
  ASSERT_NE(cap, nullptr);
  EXPECT_EQ(*cap, cpumoe::parse_isa(env, "CPUMOE_ISA"));
  EXPECT_LE(int(cpumoe::qgemm_select()->isa), int(*cap));
  const auto d = cpumoe_test::make_moe_data({2, 2, 1, 8, 8}, cpumoe::DType::f32,
                                            cpumoe::Activation::silu, false, 1);
  const cpumoe::PackedMoe pk(d.weights());
  EXPECT_LE(int(pk.kernel().isa), int(*cap));
  std::cout << "[ selected ] " << pk.kernel().name << " under CPUMOE_ISA=" << env << std::endl;
}

// Under qemu-user the model is known from QEMU_CPU (the guest sees qemu's environment). What
// getauxval reports must match the model, and the choice must follow it.
TEST(Dispatch, QemuCpuModelFeatures) {
#if !defined(__aarch64__)
  GTEST_SKIP() << "not an aarch64 build";
#else
  const char* model = std::getenv("QEMU_CPU");
  if (model == nullptr) GTEST_SKIP() << "QEMU_CPU is not set (native aarch64 or default model)";
  const cpumoe::CpuFeatures& f = cpumoe::cpu_features();
  const std::string m = model;
  const QGemmUkernel* i8mm_kernel = nullptr;
  for (const QGemmUkernel* k : cpumoe::qgemm_registry())
    if (k->isa == Isa::neon_i8mm) i8mm_kernel = k;
  if (m == "max") {
    EXPECT_TRUE(f.i8mm);
    EXPECT_TRUE(f.bf16);
    EXPECT_TRUE(f.dotprod);
    if (i8mm_kernel != nullptr && within_env_cap(Isa::neon_i8mm)) {
      EXPECT_EQ(cpumoe::qgemm_select(), i8mm_kernel);
    }
  } else if (m == "neoverse-n1" || m == "cortex-a57") {
    EXPECT_FALSE(f.i8mm);
    EXPECT_FALSE(f.bf16);
    EXPECT_EQ(f.dotprod, m == "neoverse-n1");
    EXPECT_FALSE(cpumoe::cpu_supports(Isa::neon_i8mm));
    EXPECT_NE(cpumoe::qgemm_select()->isa, Isa::neon_i8mm);
  } else {
    GTEST_SKIP() << "no expectations for QEMU_CPU=" << m;
  }
  std::cout << "[ qemu cpu ] " << m << ": i8mm=" << f.i8mm << " bf16=" << f.bf16
            << " dotprod=" << f.dotprod << " sve=" << f.sve << std::endl;
#endif
}

// A kernel the CPU cannot run is refused when packing (an ArgumentError, never a SIGILL later);
// one it can run packs fine.
TEST(Dispatch, PackedMoeRefusesUnsupportedKernels) {
  const auto d = cpumoe_test::make_moe_data({1, 1, 1, 8, 8}, cpumoe::DType::f32,
                                            cpumoe::Activation::silu, false, 2);
  for (const QGemmUkernel* k : cpumoe::qgemm_registry()) {
    if (cpumoe::cpu_supports(k->isa)) {
      const cpumoe::PackedMoe pk(d.weights(), k);
      EXPECT_EQ(&pk.kernel(), k);
    } else {
      EXPECT_THROW(cpumoe::PackedMoe(d.weights(), k), cpumoe::ArgumentError) << k->name;
    }
  }
}

// The default path end to end (whatever this CPU selects) gives the oracle's answer.
TEST(Dispatch, SelectedKernelRunsTheOp) {
  const auto d = cpumoe_test::make_moe_data({5, 4, 2, 16, 24}, cpumoe::DType::bf16,
                                            cpumoe::Activation::swigluoai, true, 3);
  const cpumoe::PackedMoe pk(d.weights());
  EXPECT_EQ(&pk.kernel(), cpumoe::qgemm_select());
  const std::vector<float> got = cpumoe_test::output_values(d, cpumoe_test::run_moe(pk, d, 1));
  const std::vector<float> want = cpumoe_ref::fused_moe(d.ref, d.ref_inputs());
  cpumoe_test::expect_close(got, want, 2e-2);
}

}  // namespace

// The AMX peak probe: a rate where the CPU has AMX (int8 twice bf16's: tdpbusd does 64 k per
// tile row, tdpbf16ps 32, at the same issue rate), false elsewhere.
TEST(Probes, AmxPeakMeasuredWhereAmxRuns) {
  cpumoe::AmxPeak peak;
  const bool ok = cpumoe::measure_amx_peak(1, 0.01, &peak);
  if (!cpumoe::cpu_supports(Isa::amx)) {
    EXPECT_FALSE(ok);
    return;
  }
#if defined(__x86_64__)
  if (!ok) GTEST_SKIP() << "this build has no AMX code";
  EXPECT_GT(peak.int8_ops, 1e11);
  EXPECT_GT(peak.bf16_flops, 5e10);
  EXPECT_GT(peak.int8_ops, 1.2 * peak.bf16_flops);
  cpumoe::AmxPeak two;
  ASSERT_TRUE(cpumoe::measure_amx_peak(2, 0.01, &two));
  EXPECT_GT(two.int8_ops, 0.0);
#endif
}
