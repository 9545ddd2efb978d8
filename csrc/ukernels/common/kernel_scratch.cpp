// kernel_scratch.h: one growing, 64-byte aligned block per thread.
#include "ukernels/common/kernel_scratch.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <new>

namespace cpumoe {

namespace {
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
}  // namespace

int32_t* kernel_scratch_i32(size_t n) {
  thread_local std::unique_ptr<void, FreeDeleter> block;
  thread_local size_t capacity = 0;  // in int32
  if (n > capacity) {
    const size_t want = std::max(n, 2 * capacity);
    const size_t bytes = (want * sizeof(int32_t) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) throw std::bad_alloc();
    block.reset(p);
    capacity = bytes / sizeof(int32_t);
  }
  return static_cast<int32_t*>(block.get());
}

}  // namespace cpumoe
