# ctest script: the object files of the ISA-flagged sources define no shared (weak / vague
# linkage: nm W, V or u) symbol at all, whatever its namespace: cpumoe's inline helpers and
# std::max<float>, std::vector<...> members or any other template instantiated there alike.
#
# Why: an inline function or template instantiation that such a file emits out of line is one
# COMDAT copy among several; the linker keeps any one of them for every caller. A copy compiled
# with -mavx512f or +i8mm would then run from the portable code on a CPU without that ISA (an
# illegal instruction). Helpers shared by ISA files therefore have internal linkage, and this
# test catches a header function that slipped through (gcc chose not to inline it).
#
#   cmake -DNM=<nm> -DOBJECTS=<objects> -DISA_SOURCES=<source file names> -P CheckIsaObjects.cmake
# One exception: DW.ref.__gxx_personality_v0, a data word (the address of the C++ personality
# routine) that every object with exception tables shares; it holds no ISA code.
cmake_minimum_required(VERSION 3.21)  # IN_LIST (script mode starts with old policies)
set(bad "")
set(checked 0)
foreach(obj IN LISTS OBJECTS)
  get_filename_component(name "${obj}" NAME)
  string(REGEX REPLACE "\\.o(bj)?$" "" src "${name}")
  if(NOT src IN_LIST ISA_SOURCES)
    continue()
  endif()
  math(EXPR checked "${checked} + 1")
  execute_process(COMMAND "${NM}" --defined-only "${obj}" OUTPUT_VARIABLE out RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} failed on ${obj}")
  endif()
  string(REGEX MATCHALL "[^\n]+" lines "${out}")
  foreach(line IN LISTS lines)
    if(line MATCHES " [WVu] " AND NOT line MATCHES " DW\\.ref\\.__gxx_personality_v0$")
      string(APPEND bad "  ${name}: ${line}\n")
    endif()
  endforeach()
endforeach()
list(LENGTH ISA_SOURCES n_isa)
if(NOT checked EQUAL n_isa)
  message(FATAL_ERROR "found ${checked} of the ${n_isa} ISA objects (${ISA_SOURCES}) in: ${OBJECTS}")
endif()
if(bad)
  message(FATAL_ERROR "ISA objects share code with the rest of the library (give these internal "
                      "linkage or force them inline):\n${bad}")
endif()
message(STATUS "${checked} ISA objects: no shared (weak / vague linkage) symbols")
