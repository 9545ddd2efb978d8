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
