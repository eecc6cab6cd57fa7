// CudaEvent: a move-only owner of a cudaEvent_t with timing enabled. ATen's CUDAEvent would do, but its header pulls in
// CUDAContext.h and with it the cuSPARSE/cuBLAS headers, which a compiler-only CUDA toolkit lacks. CUDA builds only.
#pragma once

#ifdef ZEROSHARD_WITH_CUDA

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <utility>

namespace zeroshard {

class CudaEvent {
 public:
  CudaEvent() = default;  // created lazily, on the device of the first recorded stream
  ~CudaEvent() {
    if (event_) (void)cudaEventDestroy(event_);  // never throw from a destructor (may run at exit)
  }
  CudaEvent(CudaEvent&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& o) noexcept {
    std::swap(event_, o.event_);
    return *this;
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void record(const c10::cuda::CUDAStream& stream) {
    if (!event_) C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDefault));  // timing on
    C10_CUDA_CHECK(cudaEventRecord(event_, stream.stream()));
  }
  // The stream waits (device side) for the work recorded so far; no-op if never recorded.
  void block(const c10::cuda::CUDAStream& stream) const {
    if (event_) C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), event_, 0));
  }
  bool query() const {
    if (!event_) return true;
    const cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: clear it
      return false;
    }
    C10_CUDA_CHECK(err);
    return true;
  }
  void synchronize() const {
    if (event_) C10_CUDA_CHECK(cudaEventSynchronize(event_));
  }
  // Seconds from this event to `end`; both recorded and complete.
  double seconds_to(const CudaEvent& end) const {
    float ms = 0.0f;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, event_, end.event_));
    return static_cast<double>(ms) * 1e-3;
  }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WITH_CUDA
