#include "offload/host_copy_queue.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstring>

namespace zeroshard {

HostCopyQueue::HostCopyQueue() : worker_([this] { run(); }) {}

HostCopyQueue::~HostCopyQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_one();
  worker_.join();
}

int64_t HostCopyQueue::copy(const at::Tensor& dst, const at::Tensor& src) {
  check_copy_args(dst, src, "HostCopyQueue");
  TORCH_CHECK_VALUE(dst.device().is_cpu() && src.device().is_cpu(), "HostCopyQueue.copy: dst is on ", dst.device(),
                    " and src on ", src.device(), "; a host queue copies between CPU tensors only (make the queue ",
                    "for the CUDA device instead)");
  int64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ticket = ++issued_;
    tasks_.push_back({ticket, dst, src});
  }
  work_cv_.notify_one();
  return ticket;
}

void HostCopyQueue::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stop_ and drained
    Task task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    const int64_t nbytes = static_cast<int64_t>(task.src.nbytes());
    const auto t0 = std::chrono::steady_clock::now();
    try {
      if (nbytes > 0) std::memcpy(task.dst.data_ptr(), task.src.data_ptr(), static_cast<size_t>(nbytes));
    } catch (...) {
      error = std::current_exception();
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Drop the tensors before reporting completion, so a caller that synchronized may free them at once.
    task.dst.reset();
    task.src.reset();
    lock.lock();
    if (error && !error_) {
      error_ = error;
      error_ticket_ = task.ticket;
    }
    if (!error) {
      bytes_ += nbytes;
      seconds_ += dt;
    }
    done_ = task.ticket;
    done_cv_.notify_all();
  }
}

void HostCopyQueue::synchronize(int64_t ticket) {
  if (ticket <= 0) return;
  std::unique_lock<std::mutex> lock(mu_);
  TORCH_CHECK_VALUE(ticket <= issued_, "HostCopyQueue.synchronize: ticket ", ticket, " was never issued (last is ",
                    issued_, "); pass a ticket returned by copy()");
  done_cv_.wait(lock, [&] { return done_ >= ticket; });
  if (error_ && error_ticket_ <= ticket) std::rethrow_exception(error_);
}

int64_t HostCopyQueue::last_ticket() const {
  std::lock_guard<std::mutex> lock(mu_);
  return issued_;
}

std::pair<int64_t, double> HostCopyQueue::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return {bytes_, seconds_};
}

void HostCopyQueue::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  bytes_ = 0;
  seconds_ = 0.0;
}

}  // namespace zeroshard
