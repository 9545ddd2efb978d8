// The calling thread's scratch block (scratch.h) and the public functions that report or free it.
#include "scratch.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpumoe/moe.h"

namespace cpumoe {
namespace moe_detail {

void* alloc_large(size_t bytes) {
  constexpr size_t kHuge = size_t(2) << 20;
  if (bytes < kHuge) return std::aligned_alloc(kAlign, align_up(std::max<size_t>(bytes, 1)));
  if (bytes > SIZE_MAX - kHuge) return nullptr;
  const size_t total = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, total);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (p != nullptr) (void)madvise(p, total, MADV_HUGEPAGE);  // a hint: refusal changes nothing
#endif
  return p;
}

ThreadScratch::~ThreadScratch() { std::free(p_); }

uint8_t* ThreadScratch::reserve(size_t bytes, size_t keep) {
  if (bytes > cap_) {
    const size_t cap = align_up(bytes);
    auto* p = static_cast<uint8_t*>(alloc_large(cap));
    if (p == nullptr) throw std::bad_alloc();
    if (keep > 0) std::memcpy(p, p_, std::min(keep, cap_));
    std::free(p_);
    p_ = p;
    cap_ = cap;
  }
  return p_;
}

void ThreadScratch::release() {
  std::free(p_);
  p_ = nullptr;
  cap_ = 0;
}

ThreadScratch& thread_scratch() {
  thread_local ThreadScratch s;
  return s;
}

}  // namespace moe_detail

size_t thread_scratch_bytes() { return moe_detail::thread_scratch().capacity(); }

void release_thread_scratch() { moe_detail::thread_scratch().release(); }

}  // namespace cpumoe
