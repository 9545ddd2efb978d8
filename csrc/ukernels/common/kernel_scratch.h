// Per-thread scratch memory for microkernels that need a buffer made per call (e.g. the W4A8
// kernels' accumulator start values). Defined in kernel_scratch.cpp, built without ISA flags: an
// ISA file must not instantiate std::vector or any other template (cmake/CheckIsaObjects.cmake).
#pragma once

#include <cstddef>
#include <cstdint>

namespace cpumoe {

/// At least @p n int32 of the calling thread's scratch, 64-byte aligned, valid until that thread's
/// next call (the contents are not kept). Grows as needed; never returns nullptr (throws
/// std::bad_alloc when it cannot grow).
int32_t* kernel_scratch_i32(size_t n);

}  // namespace cpumoe
