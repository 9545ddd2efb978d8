// The calling thread's scratch block: every buffer of a chunk is carved from one 64-byte aligned
// block owned by the *calling* thread (thread_local), which grows to the largest chunk seen and is
// reused by later calls (no allocation, no page faults in steady state). Concurrent callers each
// have their own block; the OpenMP workers of a call only write into their caller's block.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cpumoe {
namespace moe_detail {

constexpr size_t kAlign = 64;

inline size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// A 64-byte aligned block of at least `bytes` for the big buffers (packed weights, scratch),
// freed with std::free; nullptr when out of memory. From 2 MB on it is 2 MB aligned and asks
// Linux for transparent huge pages (madvise; where THP is "madvise" only this gets them): the
// kernels stream these buffers, and with 4 KB pages every 4 KB of weights costs a page walk
// (measured, AMX int8, one thread, 64 cold experts of 1.5-3 MB: 1.1-1.3 -> 1.4-1.55 TOP/s).
void* alloc_large(size_t bytes);

// Grows, never shrinks (release() frees it).
class ThreadScratch {
 public:
  ThreadScratch() = default;
  ~ThreadScratch();
  ThreadScratch(const ThreadScratch&) = delete;
  ThreadScratch& operator=(const ThreadScratch&) = delete;

  // Makes the block at least `bytes` long; its first `keep` bytes survive a reallocation.
  uint8_t* reserve(size_t bytes, size_t keep);
  size_t capacity() const { return cap_; }
  void release();

 private:
  uint8_t* p_ = nullptr;
  size_t cap_ = 0;
};

ThreadScratch& thread_scratch();

}  // namespace moe_detail
}  // namespace cpumoe
