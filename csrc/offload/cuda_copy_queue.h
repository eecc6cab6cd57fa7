// CudaCopyQueue: CopyQueue on a dedicated CUDA stream from torch's pool, so transfers overlap compute on the caller's
// stream. Ordering against the caller is explicit: wait_current_stream() before copies that read what compute writes,
// current_stream_wait(ticket) before compute that reads what a copy writes. CUDA builds only.
#pragma once

#ifdef ZEROSHARD_WITH_CUDA

#include <c10/cuda/CUDAStream.h>

#include <deque>
#include <mutex>

#include "offload/copy_queue.h"
#include "offload/cuda_event.h"

namespace zeroshard {

class CudaCopyQueue final : public CopyQueue {
 public:
  explicit CudaCopyQueue(c10::Device device);  // cuda or cuda:<index>; no index: the current device

  c10::Device device() const override { return device_; }
  void wait_current_stream() override;
  // dst/src: CPU tensors or CUDA tensors on this queue's device. Pinned host memory makes the copy truly async;
  // pageable host memory makes the host wait for it (CUDA stages the bytes).
  int64_t copy(const at::Tensor& dst, const at::Tensor& src) override;
  void synchronize(int64_t ticket) override;
  void current_stream_wait(int64_t ticket) override;
  int64_t last_ticket() const override;
  std::pair<int64_t, double> stats() override;
  void reset_stats() override;

 private:
  struct Entry {
    int64_t ticket;
    CudaEvent start, end;  // timing events around the copy on stream_
    at::Tensor dst, src;   // owned until the copy ends
    int64_t bytes;
  };
  // Retires entries from the front while `done(entry)`, adding their bytes and times to the stats. mu_ held.
  template <typename Done>
  void retire_while(Done done);

  c10::Device device_;
  c10::cuda::CUDAStream stream_;
  mutable std::mutex mu_;
  std::deque<Entry> pending_;  // in ticket order
  int64_t issued_ = 0;
  int64_t bytes_ = 0;
  double seconds_ = 0.0;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WITH_CUDA
