// BufferCache: a CPU allocator that keeps freed blocks for the next allocation of the same size.
//
// ZeRO stage 3 frees every unit's gathered buffers after use and allocates them again at the next gather, twice per
// step. On the GPU torch's caching allocator makes that reuse; on the CPU each allocation of a few MiB is fresh memory
// from the OS (glibc maps large blocks and returns them on free), and the first write to every page faults: about
// 0.27 ms per MiB on this 2-core VM, more than the collective itself moves. Buffers allocated here keep their storage
// resizable: a stage-3 full buffer keeps its storage object across resize_(0) and resize_(n) (tensors autograd saved
// in forward point into it) while the memory behind it comes back from the cache.
//
// One cache per process, bounded: a freed block is kept only while the cached bytes stay within limit() (0, the
// default, caches nothing; the stage-3 runtime raises it to a few of its units' gather sizes). Thread-safe: blocks may
// be freed on a backend thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace zeroshard {

struct BufferCacheStats {
  int64_t limit_bytes = 0;
  int64_t cached_bytes = 0;  // held by the cache, free
  int64_t hits = 0;          // allocations served from the cache
  int64_t misses = 0;        // allocations that took fresh memory
};

// The process's cache as a c10::Allocator (never destroyed: storages may outlive every Python object).
c10::Allocator* buffer_cache_allocator();

// A 1-D CPU tensor of `numel` elements (uninitialised) whose resizable storage allocates from the cache.
at::Tensor cached_empty(int64_t numel, at::ScalarType dtype);

// Raises or lowers the cache's bound (bytes >= 0); lowering frees cached blocks beyond it.
void set_buffer_cache_limit(int64_t bytes);
BufferCacheStats buffer_cache_stats();

}  // namespace zeroshard
