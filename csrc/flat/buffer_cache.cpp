#include "flat/buffer_cache.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

namespace zeroshard {
namespace {

constexpr size_t kCacheAlign = 64;

class BufferCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nullptr;
    if (nbytes > 0) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = free_.find(nbytes);
        if (it != free_.end()) {
          ptr = it->second;
          free_.erase(it);
          cached_ -= static_cast<int64_t>(nbytes);
          ++hits_;
        } else {
          ++misses_;
        }
      }
      if (ptr == nullptr) {
        const size_t rounded = (nbytes + kCacheAlign - 1) / kCacheAlign * kCacheAlign;
        ptr = std::aligned_alloc(kCacheAlign, rounded);
        TORCH_CHECK(ptr != nullptr, "zeroshard buffer cache: allocating ", nbytes, " bytes failed (out of memory)");
      }
    }
    // The context records the size, so the deleter can file the block under it.
    auto* block = new Block{ptr, nbytes};
    return {ptr, block, &BufferCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }  // the deleter needs the size: no raw frees

  void copy_data(void* dest, const void* src, std::size_t count) const final { default_copy_data(dest, src, count); }

  void set_limit(int64_t bytes) {
    TORCH_CHECK_VALUE(bytes >= 0, "buffer cache limit must be >= 0 bytes, got ", bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = bytes;
    while (cached_ > limit_ && !free_.empty()) {
      auto it = std::prev(free_.end());  // the largest first
      cached_ -= static_cast<int64_t>(it->first);
      std::free(it->second);
      free_.erase(it);
    }
  }

  BufferCacheStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {limit_, cached_, hits_, misses_};
  }

 private:
  struct Block {
    void* ptr;
    size_t nbytes;
  };

  static void release(void* ctx);

  void put(void* ptr, size_t nbytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cached_ + static_cast<int64_t>(nbytes) <= limit_) {
        free_.emplace(nbytes, ptr);
        cached_ += static_cast<int64_t>(nbytes);
        return;
      }
    }
    std::free(ptr);
  }

  std::mutex mutex_;
  std::multimap<size_t, void*> free_;  // free blocks by exact size
  int64_t limit_ = 0;
  int64_t cached_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

BufferCache& cache() {
  static auto* instance = new BufferCache();  // never destroyed: blocks may be freed during interpreter shutdown
  return *instance;
}

void BufferCache::release(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  if (block->ptr != nullptr) cache().put(block->ptr, block->nbytes);
  delete block;
}

}  // namespace

c10::Allocator* buffer_cache_allocator() { return &cache(); }

at::Tensor cached_empty(int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(numel >= 0, "cached_empty: numel=", numel, " is negative");
  return at::detail::empty_generic({numel}, buffer_cache_allocator(), c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                   std::nullopt);
}

void set_buffer_cache_limit(int64_t bytes) { cache().set_limit(bytes); }

BufferCacheStats buffer_cache_stats() { return cache().stats(); }

}  // namespace zeroshard
