// Host buffers of exactly the requested size, pinned (page-locked) when a CUDA device can use them, with live-byte
// accounting, and a check of a host-memory budget against what the OS reports as available.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace zeroshard {

// A 1-D CPU tensor of exactly `numel` elements (numel 0 is fine). With `pin`, in a CUDA build, with a CUDA device
// present at run time: cudaHostAlloc memory of exactly numel * itemsize bytes (torch's caching host allocator would
// round up to a power of two, up to doubling the footprint of large offloaded states); is_pinned() is then true.
// Otherwise: 64-byte-aligned pageable memory. Contents are uninitialised. Throws c10::Error naming the byte count and
// the reason when the allocation fails.
at::Tensor empty_host(int64_t numel, at::ScalarType dtype, bool pin);

// Bytes currently held by live empty_host tensors (and the peaks since process start), by kind.
struct HostMemoryStats {
  int64_t pinned_bytes = 0;
  int64_t unpinned_bytes = 0;
  int64_t peak_pinned_bytes = 0;
  int64_t peak_unpinned_bytes = 0;
};
HostMemoryStats host_memory_stats();

// MemAvailable from /proc/meminfo in bytes (fallback: available physical pages * page size).
int64_t host_available_bytes();

// Throws ValueError naming `what`, the need and the availability in GiB when nbytes > host_available_bytes().
void check_host_budget(int64_t nbytes, const std::string& what);

}  // namespace zeroshard
