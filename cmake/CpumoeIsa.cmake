# Build-time ISA gate, read from the one ISA table csrc/include/cpumoe/isa_table.def: for every
# level of this architecture, the option CPUMOE_ENABLE_<option>, the per-file flags
# CPUMOE_ISA_FLAGS_<name> (a list) and CPUMOE_HAVE_<have> (ON when the compiler takes the flags).
# Kernel files get their flags through cpumoe_add_kernel (csrc/CMakeLists.txt) only; everything
# else stays at the baseline, so no ISA instruction can reach code that runs before the run-time
# CPU check.
include(CheckCXXSourceCompiles)

if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(aarch64|arm64|ARM64)$")
  set(CPUMOE_ARCH aarch64)
  set(cpumoe_isa_header arm_neon.h)
elseif(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  set(CPUMOE_ARCH x86_64)
  set(cpumoe_isa_header immintrin.h)
else()
  set(CPUMOE_ARCH other)
endif()

set(CPUMOE_ISA_TABLE ${CMAKE_CURRENT_LIST_DIR}/../csrc/include/cpumoe/isa_table.def)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${CPUMOE_ISA_TABLE})
file(STRINGS ${CPUMOE_ISA_TABLE} cpumoe_isa_rows REGEX "^CPUMOE_ISA\\(")

# cpumoe_check_isa(<VAR> <flags list> <macros list>): VAR is ON when the compiler takes the flags
# and they define every macro (with the architecture's intrinsics header included, so a flag
# the header cannot use fails here, not in a kernel file).
function(cpumoe_check_isa var flags macros)
  set(src "#include <${cpumoe_isa_header}>\n")
  foreach(m IN LISTS macros)
    string(APPEND src "#if !defined(${m})\n#error \"${m} not defined\"\n#endif\n")
  endforeach()
  string(APPEND src "int main() { return 0; }\n")
  list(JOIN flags " " CMAKE_REQUIRED_FLAGS)
  check_cxx_source_compiles("${src}" ${var}_COMPILES)
  set(${var} ${${var}_COMPILES} PARENT_SCOPE)
endfunction()

set(CPUMOE_ISA_ALL "")  # every level of the table
set(CPUMOE_ISA_NAMES portable)  # the levels built in, in table order
set(CPUMOE_ISA_FLAGS_portable "")
set(cpumoe_isa_summary "")
foreach(row IN LISTS cpumoe_isa_rows)
  # Nine groups (the most a CMake regex holds): the value stays C++'s.
  if(NOT row MATCHES "^CPUMOE_ISA\\(([a-z0-9_]+), *[0-9]+, *([a-z0-9_]+), *([a-z0-9_]+), *([A-Z0-9_-]+), *([A-Z0-9_-]+), *(ON|OFF), *\"([^\"]*)\", *\"([^\"]*)\", *(.+)\\)$")
    message(FATAL_ERROR "isa_table.def: cannot read the row: ${row}")
  endif()
  set(name ${CMAKE_MATCH_1})
  list(APPEND CPUMOE_ISA_ALL ${name})
  set(arch ${CMAKE_MATCH_2})
  set(req ${CMAKE_MATCH_3})
  set(have ${CMAKE_MATCH_4})
  set(opt ${CMAKE_MATCH_5})
  set(default ${CMAKE_MATCH_6})
  separate_arguments(flags UNIX_COMMAND "${CMAKE_MATCH_7}")
  separate_arguments(macros UNIX_COMMAND "${CMAKE_MATCH_8}")
  if(arch STREQUAL "any")
    continue()  # portable: always built, no option
  endif()
  # Every option and CPUMOE_HAVE_* exists on every architecture (OFF where it does not apply).
  option(CPUMOE_ENABLE_${opt} "Build the ${arch} kernels of option ${opt} (isa_table.def) when the compiler takes their flags" ${default})
  set(CPUMOE_HAVE_${have} OFF)
  if(NOT arch STREQUAL CPUMOE_ARCH)
    continue()
  endif()
  if(CPUMOE_ENABLE_${opt} AND req IN_LIST CPUMOE_ISA_NAMES)
    cpumoe_check_isa(CPUMOE_HAVE_${have} "${flags}" "${macros}")
  endif()
  if(CPUMOE_HAVE_${have})
    list(APPEND CPUMOE_ISA_NAMES ${name})
    set(CPUMOE_ISA_FLAGS_${name} ${flags})
  endif()
  list(APPEND cpumoe_isa_summary "${name}=${CPUMOE_HAVE_${have}}")
endforeach()
if(CPUMOE_ARCH STREQUAL "x86_64")
  list(JOIN cpumoe_isa_summary " " cpumoe_isa_summary)
  message(STATUS "cpumoe: x86 kernels ${cpumoe_isa_summary}")
endif()
