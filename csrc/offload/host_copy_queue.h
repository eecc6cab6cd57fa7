// HostCopyQueue: CopyQueue whose copies are memcpys on one worker thread, so host-to-host transfers (CPU-only
// offload, tests) overlap the caller's compute the same way device copies do.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "offload/copy_queue.h"

namespace zeroshard {

class HostCopyQueue final : public CopyQueue {
 public:
  HostCopyQueue();
  ~HostCopyQueue() override;  // finishes every queued copy, then joins the worker
  HostCopyQueue(const HostCopyQueue&) = delete;
  HostCopyQueue& operator=(const HostCopyQueue&) = delete;

  c10::Device device() const override { return c10::Device(c10::kCPU); }
  void wait_current_stream() override {}
  int64_t copy(const at::Tensor& dst, const at::Tensor& src) override;  // dst and src must be CPU tensors
  void synchronize(int64_t ticket) override;
  void current_stream_wait(int64_t ticket) override { synchronize(ticket); }
  int64_t last_ticket() const override;
  std::pair<int64_t, double> stats() override;
  void reset_stats() override;

 private:
  struct Task {
    int64_t ticket;
    at::Tensor dst, src;  // owned until the copy ends
  };
  void run();

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // worker: a task arrived or stop
  std::condition_variable done_cv_;  // waiters: done_ advanced
  std::deque<Task> tasks_;
  int64_t issued_ = 0;
  int64_t done_ = 0;  // every ticket <= done_ has finished (or failed)
  int64_t error_ticket_ = 0;
  std::exception_ptr error_;  // the first failure; later copies still run
  int64_t bytes_ = 0;
  double seconds_ = 0.0;
  bool stop_ = false;
  std::thread worker_;  // last: started once every other member exists
};

}  // namespace zeroshard
