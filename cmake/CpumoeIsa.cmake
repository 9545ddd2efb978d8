# Build-time ISA gate: which per-file -march flags the compiler accepts. Kernel files get their
# flag through set_source_files_properties only; everything else stays at the baseline, so no
# ISA instruction can reach code that runs before the run-time CPU check.
include(CheckCXXCompilerFlag)
include(CheckCXXSourceCompiles)

if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(aarch64|arm64|ARM64)$")
  set(CPUMOE_ARCH aarch64)
elseif(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  set(CPUMOE_ARCH x86_64)
else()
  set(CPUMOE_ARCH other)
endif()

# cpumoe_check_isa(<VAR> <flag> <intrinsic test source>): VAR is ON when the compiler takes the
# flag and compiles the test with it.
function(cpumoe_check_isa var flag source)
  set(CMAKE_REQUIRED_FLAGS "${flag}")
  check_cxx_source_compiles("${source}" ${var}_COMPILES)
  set(${var} ${${var}_COMPILES} PARENT_SCOPE)
endfunction()

set(CPUMOE_I8MM_FLAG "-march=armv8.2-a+i8mm")
set(CPUMOE_BF16_FLAG "-march=armv8.2-a+bf16")
set(CPUMOE_DOTPROD_FLAG "-march=armv8.2-a+dotprod")
set(CPUMOE_HAVE_I8MM OFF)
set(CPUMOE_HAVE_BF16 OFF)
set(CPUMOE_HAVE_DOTPROD OFF)
if(CPUMOE_ARCH STREQUAL "aarch64")
  if(CPUMOE_ENABLE_I8MM)
    cpumoe_check_isa(CPUMOE_HAVE_I8MM "${CPUMOE_I8MM_FLAG}" "
      #include <arm_neon.h>
      int main() { int32x4_t a = vdupq_n_s32(0); int8x16_t b = vdupq_n_s8(1);
                   a = vmmlaq_s32(a, b, b); return vgetq_lane_s32(a, 0) == 8 ? 0 : 1; }")
  endif()
  if(CPUMOE_ENABLE_BF16)
    cpumoe_check_isa(CPUMOE_HAVE_BF16 "${CPUMOE_BF16_FLAG}" "
      #include <arm_neon.h>
      int main() { float32x4_t a = vdupq_n_f32(0); bfloat16x8_t b = vcvtq_low_bf16_f32(a);
                   a = vbfmmlaq_f32(a, b, b); return (int)vgetq_lane_f32(a, 0); }")
  endif()
  if(CPUMOE_ENABLE_DOTPROD)
    cpumoe_check_isa(CPUMOE_HAVE_DOTPROD "${CPUMOE_DOTPROD_FLAG}" "
      #include <arm_neon.h>
      int main() { int32x4_t a = vdupq_n_s32(0); int8x16_t b = vdupq_n_s8(1);
                   a = vdotq_s32(a, b, b); return vgetq_lane_s32(a, 0) == 4 ? 0 : 1; }")
  endif()
endif()

# x86-64: per-file flags for the AVX2, AVX-512 VNNI, AVX-512 BF16 and AMX kernels (never global).
option(CPUMOE_ENABLE_AVX2 "Build the x86-64 AVX2 kernels when the compiler takes -mavx2" ON)
option(CPUMOE_ENABLE_AVX512 "Build the x86-64 AVX-512 VNNI and BF16 kernels when the compiler takes them" ON)
# AMX is off by default: its kernel has not yet run on AMX hardware (only its tile logic, against a
# software model of the tile instructions); turn it on where a Sapphire Rapids machine tests it.
option(CPUMOE_ENABLE_AMX "Build the x86-64 AMX-INT8 kernel (needs the AVX-512 ones too)" OFF)
set(CPUMOE_AVX2_FLAG -mavx2 -mfma -mf16c)
set(CPUMOE_AVX512VNNI_FLAG -mavx512f -mavx512bw -mavx512vl -mavx512vnni)
set(CPUMOE_AVX512BF16_FLAG ${CPUMOE_AVX512VNNI_FLAG} -mavx512bf16)
set(CPUMOE_AMX_FLAG ${CPUMOE_AVX512VNNI_FLAG} -mamx-tile -mamx-int8)
set(CPUMOE_HAVE_AVX2 OFF)
set(CPUMOE_HAVE_AVX512VNNI OFF)
set(CPUMOE_HAVE_AVX512BF16 OFF)
set(CPUMOE_HAVE_AMX OFF)
if(CPUMOE_ARCH STREQUAL "x86_64")
  if(CPUMOE_ENABLE_AVX2)
    cpumoe_check_isa(CPUMOE_HAVE_AVX2 "-mavx2 -mfma -mf16c" "
      #include <immintrin.h>
      int main() { __m256i a = _mm256_set1_epi16(3);
                   a = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_set1_epi8(1)), a);
                   return _mm256_extract_epi32(a, 0) == 6 ? 0 : 1; }")
  endif()
  if(CPUMOE_ENABLE_AVX512)
    cpumoe_check_isa(CPUMOE_HAVE_AVX512VNNI "-mavx512f -mavx512bw -mavx512vl -mavx512vnni" "
      #include <immintrin.h>
      int main() { __m512i a = _mm512_setzero_si512(), b = _mm512_set1_epi8(1);
                   a = _mm512_dpbusd_epi32(a, b, b);
                   return _mm_cvtsi128_si32(_mm512_castsi512_si128(a)) == 4 ? 0 : 1; }")
  endif()
  if(CPUMOE_ENABLE_AVX512 AND CPUMOE_HAVE_AVX512VNNI)
    cpumoe_check_isa(CPUMOE_HAVE_AVX512BF16 "-mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx512bf16" "
      #include <immintrin.h>
      int main() { __m512 a = _mm512_setzero_ps();
                   __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80);
                   a = _mm512_dpbf16_ps(a, b, b);
                   return _mm_cvtss_f32(_mm512_castps512_ps128(a)) == 2.0f ? 0 : 1; }")
  endif()
  if(CPUMOE_ENABLE_AMX AND CPUMOE_HAVE_AVX512VNNI)
    cpumoe_check_isa(CPUMOE_HAVE_AMX "-mavx512f -mavx512bw -mavx512vl -mavx512vnni -mamx-tile -mamx-int8" "
      #include <immintrin.h>
      int main(int argc, char**) { if (argc > 1) { _tile_loadd(0, nullptr, 64); _tile_dpbusd(2, 0, 1);
                   _tile_release(); } return 0; }")
  endif()
  message(STATUS "cpumoe: x86 kernels avx2=${CPUMOE_HAVE_AVX2} avx512_vnni=${CPUMOE_HAVE_AVX512VNNI} "
                 "avx512_bf16=${CPUMOE_HAVE_AVX512BF16} amx=${CPUMOE_HAVE_AMX}")
endif()
