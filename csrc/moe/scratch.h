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
