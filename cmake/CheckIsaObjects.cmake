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
#
# Second mode, -DKERNEL_DIR=<csrc/ukernels> (the KernelsDoNotAllocate test): no kernel source calls
# an allocator (new, malloc and kin, std::vector / string / function / containers, the removed
# kernel_scratch): every buffer a kernel uses is planned by its caller (e.g. q4gemm.h's
# scratch_bytes, pack_scratch_bytes for the packers), so a kernel never throws bad_alloc inside a
# parallel region. Comments are not read. Exempt: only the files below, which hold no kernel (no
# per-line exemption: packing too runs in a parallel loop, PackedExperts').
#
#   cmake -DKERNEL_DIR=<dir> -P CheckIsaObjects.cmake
cmake_minimum_required(VERSION 3.21)  # IN_LIST (script mode starts with old policies)
if(DEFINED KERNEL_DIR)
  # registry.cpp: the registries' lists, built once on first use; probe/probes.cpp: the AMX
  # peak probe's threads (a measurement run on request, never from an op).
  set(exempt registry.cpp probe/probes.cpp)
  set(alloc_re "std::(vector|string|deque|list|map|set|unordered_map|unordered_set|function|")
  string(APPEND alloc_re "make_unique|make_shared|allocator)|(^|[^A-Za-z0-9_])(new|malloc|calloc|")
  string(APPEND alloc_re "realloc|aligned_alloc|posix_memalign|kernel_scratch[A-Za-z0-9_]*)")
  string(APPEND alloc_re "([^A-Za-z0-9_]|$)")
  file(GLOB_RECURSE sources RELATIVE "${KERNEL_DIR}" "${KERNEL_DIR}/*.h" "${KERNEL_DIR}/*.cpp"
       "${KERNEL_DIR}/*.inc" "${KERNEL_DIR}/*.def")
  set(bad "")
  set(scanned 0)
  foreach(rel IN LISTS sources)
    if(rel IN_LIST exempt)
      continue()
    endif()
    math(EXPR scanned "${scanned} + 1")
    file(READ "${KERNEL_DIR}/${rel}" text)
    # One list element per line: the characters a CMake list treats specially go first.
    string(REGEX REPLACE "[][;]" "_" text "${text}")
    string(REPLACE "\n" ";" lines "${text}")
    set(n 0)
    foreach(line IN LISTS lines)
      math(EXPR n "${n} + 1")
      string(REGEX REPLACE "//.*$" "" code "${line}")
      if(code MATCHES "${alloc_re}")
        string(STRIP "${code}" code)
        string(APPEND bad "  ${rel}:${n}: ${code}\n")
      endif()
    endforeach()
  endforeach()
  if(scanned EQUAL 0)
    message(FATAL_ERROR "no kernel sources found under ${KERNEL_DIR}")
  endif()
  if(bad)
    message(FATAL_ERROR "kernel sources allocate (take the buffer from the caller: plan it in "
                        "the kernel's scratch_bytes or pack_scratch_bytes):\n${bad}")
  endif()
  message(STATUS "${scanned} kernel sources: no allocation")
  return()
endif()
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
