// CPU feature detection. Compiled at the architecture baseline: no -march flag may reach this file.
#include "cpumoe/cpu_features.h"

#include <cstdlib>
#include <mutex>
#include <stdexcept>

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1UL << 1)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20)
#endif
#ifndef HWCAP_SVE
#define HWCAP_SVE (1UL << 22)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1UL << 13)
#endif
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1UL << 14)
#endif
#endif

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace cpumoe {
namespace {

#if defined(__x86_64__)
uint64_t read_xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t(edx) << 32) | eax;
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__aarch64__) && defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP);
  const unsigned long hw2 = getauxval(AT_HWCAP2);
  f.neon = (hw & HWCAP_ASIMD) != 0;
  f.dotprod = (hw & HWCAP_ASIMDDP) != 0;
  f.sve = (hw & HWCAP_SVE) != 0;
  f.i8mm = (hw2 & HWCAP2_I8MM) != 0;
  f.bf16 = (hw2 & HWCAP2_BF16) != 0;
#elif defined(__aarch64__)
  f.neon = true;  // AArch64 always has Advanced SIMD; the rest is unknown without auxv
#elif defined(__x86_64__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = (c >> 27) & 1;
  const bool fma = (c >> 12) & 1;
  const bool f16c = (c >> 29) & 1;
  const uint64_t xcr0 = osxsave ? read_xcr0() : 0;
  const bool os_avx = (xcr0 & 0x6) == 0x6;             // XMM + YMM state
  const bool os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;  // opmask + ZMM state
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;     // XTILECFG + XTILEDATA
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const unsigned b7 = b, c7 = c, d7 = d;
  __cpuid_count(7, 1, a, b, c, d);
  const unsigned a71 = a;
  f.avx2 = os_avx && ((b7 >> 5) & 1);
  f.fma = os_avx && fma;
  f.f16c = os_avx && f16c;
  f.avx512f = os_avx512 && ((b7 >> 16) & 1);
  f.avx512bw = os_avx512 && ((b7 >> 30) & 1);
  f.avx512vl = os_avx512 && ((b7 >> 31) & 1);
  f.avx512vnni = os_avx512 && ((c7 >> 11) & 1);
  f.avx512bf16 = os_avx512 && ((a71 >> 5) & 1);
  f.avx_vnni = os_avx && ((a71 >> 4) & 1);
  // AMX also needs the per-process permission (arch_prctl): the amx row's enable step.
  f.amx_bf16 = os_amx && ((d7 >> 22) & 1);
  f.amx_tile = os_amx && ((d7 >> 24) & 1);
  f.amx_int8 = os_amx && ((d7 >> 25) & 1);
#endif
  return f;
}

// Linux hands out the AMX tile data state only on request (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA = 18), once per process for all its threads; without it tile instructions
// fault. The amx row's enable step: asked once, the first time an AMX kernel is selected or
// checked (cpu_supports), never by the yes/no query cpu_has, and only where the CPU and XCR0
// report AMX. The request also makes the kernel reserve signal frames large enough for the
// tile state (it refuses when a thread's sigaltstack is too small).
bool amx_permission() {
  static const bool granted = [] {
#if defined(__x86_64__) && defined(__linux__)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
#else
    return false;
#endif
  }();
  return granted;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

const char* target_arch() {
#if defined(__aarch64__)
  return "aarch64";
#elif defined(__x86_64__)
  return "x86_64";
#else
  return "other";
#endif
}

const char* isa_name(Isa isa) {
  switch (isa) {
#define CPUMOE_ISA(name, ...) \
  case Isa::name: return #name;
#include "cpumoe/isa_table.def"
#undef CPUMOE_ISA
  }
  return "?";
}

std::vector<Isa> isa_ladder() {
  std::vector<Isa> ladder;
  const std::string arch = target_arch();
  // The rows are in ascending value order, so prepending puts the best level first and the
  // portable row (arch `any`, value 0) last.
#define CPUMOE_ISA(name, value, row_arch, ...) \
  if (arch == #row_arch || std::string(#row_arch) == "any") ladder.insert(ladder.begin(), Isa::name);
#include "cpumoe/isa_table.def"
#undef CPUMOE_ISA
  return ladder;
}

Isa parse_isa(const std::string& name, const char* what) {
  std::string names;
  for (Isa isa : isa_ladder()) {
    if (name == isa_name(isa)) return isa;
    names += names.empty() ? "" : ", ";
    names += isa_name(isa);
  }
  throw std::invalid_argument(std::string(what) + ": '" + name + "' is not an ISA level of " +
                              target_arch() + " (one of: " + names + ")");
}

bool cpu_has(Isa isa) {
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    // A row's predicate after the level it requires (portable requires itself: no recursion).
#define CPUMOE_ISA(name, value, arch, req, have, option, dflt, flags, macros, predicate, enable) \
  case Isa::name:                                                                                  \
    return (Isa::req == Isa::name || cpu_has(Isa::req)) && (predicate);
#include "cpumoe/isa_table.def"
#undef CPUMOE_ISA
  }
  return false;
}

bool cpu_supports(Isa isa) {
  if (!cpu_has(isa)) return false;
  switch (isa) {
    // The level's enable step (memoized where it has an effect, as amx_permission is) after
    // that of the level it requires.
#define CPUMOE_ISA(name, value, arch, req, have, option, dflt, flags, macros, predicate, enable) \
  case Isa::name:                                                                                  \
    return (Isa::req == Isa::name || cpu_supports(Isa::req)) && (enable);
#include "cpumoe/isa_table.def"
#undef CPUMOE_ISA
  }
  return false;
}

const Isa* env_isa_cap() {
  static Isa cap;
  static const Isa* result = [] () -> const Isa* {
    const char* v = std::getenv("CPUMOE_ISA");
    if (v == nullptr || *v == '\0') return nullptr;
    cap = parse_isa(v, "CPUMOE_ISA");
    return &cap;
  }();
  return result;
}

}  // namespace cpumoe
