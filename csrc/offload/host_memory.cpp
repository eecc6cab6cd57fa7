#include "offload/host_memory.h"

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>

#ifdef ZEROSHARD_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace zeroshard {
namespace {

constexpr int64_t kAlign = 64;

struct Counter {
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};

  void add(int64_t n) {
    const int64_t now = live.fetch_add(n) + n;
    int64_t p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
  }
  void sub(int64_t n) { live.fetch_sub(n); }
};

Counter& pinned_counter() {
  static Counter c;
  return c;
}
Counter& unpinned_counter() {
  static Counter c;
  return c;
}

#ifdef ZEROSHARD_WITH_CUDA
// Pinning only pays off (and cudaHostAlloc only succeeds) with a device to copy to.
bool can_pin() { return at::globalContext().hasCUDA(); }
#endif

std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", static_cast<double>(bytes) / static_cast<double>(int64_t{1} << 30));
  return buf;
}

}  // namespace

at::Tensor empty_host(int64_t numel, at::ScalarType dtype, bool pin) {
  TORCH_CHECK_VALUE(numel >= 0, "empty_host: numel=", numel, " is negative; pass a count of elements >= 0");
  const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
#ifdef ZEROSHARD_WITH_CUDA
  if (pin && can_pin()) {
    // Allocates in (and, on first use, creates) the current device's context: set the rank's device first.
    void* ptr = nullptr;
    // cudaHostAlloc of 0 bytes may return a null pointer; from_blob accepts that for an empty tensor.
    const cudaError_t err = cudaHostAlloc(&ptr, static_cast<size_t>(nbytes), cudaHostAllocDefault);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // not a sticky error: clear it so a later, unrelated check does not report it
      TORCH_CHECK(false, "empty_host: cudaHostAlloc of ", nbytes, " bytes (", gib(nbytes),
                  " GiB) of pinned host memory failed: ", cudaGetErrorString(err),
                  "; free host memory, lower the offloaded size, or pass pin=False");
    }
    pinned_counter().add(nbytes);
    return at::from_blob(
        ptr, {numel},
        [nbytes](void* p) {
          cudaFreeHost(p);
          pinned_counter().sub(nbytes);
        },
        options);
  }
#endif
  // aligned_alloc needs a size that is a multiple of the alignment (and > 0 to return a unique pointer).
  const int64_t padded = std::max<int64_t>(kAlign, (nbytes + kAlign - 1) / kAlign * kAlign);
  void* ptr = std::aligned_alloc(kAlign, static_cast<size_t>(padded));
  TORCH_CHECK(ptr != nullptr, "empty_host: allocating ", nbytes, " bytes (", gib(nbytes),
              " GiB) of host memory failed (out of memory); free host memory or lower the offloaded size");
  unpinned_counter().add(nbytes);
  return at::from_blob(
      ptr, {numel},
      [nbytes](void* p) {
        std::free(p);
        unpinned_counter().sub(nbytes);
      },
      options);
}

HostMemoryStats host_memory_stats() {
  HostMemoryStats s;
  s.pinned_bytes = pinned_counter().live.load();
  s.unpinned_bytes = unpinned_counter().live.load();
  s.peak_pinned_bytes = pinned_counter().peak.load();
  s.peak_unpinned_bytes = unpinned_counter().peak.load();
  return s;
}

int64_t host_available_bytes() {
  // C stdio rather than iostreams: no locale machinery, nothing that depends on the libstdc++ the process loaded.
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    long long kib = -1;
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
      kib = -1;
    }
    std::fclose(f);
    if (kib >= 0) return static_cast<int64_t>(kib) * 1024;
  }
  // Older kernels (< 3.14) have no MemAvailable: free physical pages are a lower bound.
  return static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

void check_host_budget(int64_t nbytes, const std::string& what) {
  const int64_t available = host_available_bytes();
  TORCH_CHECK_VALUE(nbytes <= available, what, " needs ", gib(nbytes), " GiB of host memory but only ", gib(available),
                    " GiB is available (MemAvailable in /proc/meminfo); lower the model size or the number of ranks ",
                    "per host, or free host memory");
}

}  // namespace zeroshard
