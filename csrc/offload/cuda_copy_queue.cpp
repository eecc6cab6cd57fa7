#ifdef ZEROSHARD_WITH_CUDA

#include "offload/cuda_copy_queue.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

namespace zeroshard {
namespace {

c10::Device with_index(c10::Device device) {
  TORCH_CHECK_VALUE(device.is_cuda(), "CudaCopyQueue: device ", device, " is not a CUDA device");
  return device.has_index() ? device : c10::Device(c10::kCUDA, c10::cuda::current_device());
}

}  // namespace

CudaCopyQueue::CudaCopyQueue(c10::Device device)
    : device_(with_index(device)), stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index())) {}

void CudaCopyQueue::wait_current_stream() {
  c10::cuda::CUDAGuard guard(device_);  // events belong to the device current when they are first recorded
  CudaEvent ready;
  ready.record(c10::cuda::getCurrentCUDAStream(device_.index()));
  ready.block(stream_);
}

int64_t CudaCopyQueue::copy(const at::Tensor& dst, const at::Tensor& src) {
  check_copy_args(dst, src, "CudaCopyQueue");
  for (const at::Tensor* t : {&dst, &src}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() || t->device() == device_, "CudaCopyQueue.copy: ", t == &dst ? "dst" : "src",
                      " is on ", t->device(), " but the queue runs on ", device_, "; pass CPU tensors or tensors on ",
                      device_, " (one queue per device)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Drop finished entries now so the deque (and the tensors it keeps alive) stays short without any host wait.
  retire_while([](Entry& e) { return e.end.query(); });
  const int64_t bytes = static_cast<int64_t>(src.nbytes());
  pending_.push_back(Entry{issued_ + 1, CudaEvent(), CudaEvent(), dst, src, bytes});
  Entry& e = pending_.back();
  try {
    c10::cuda::CUDAStreamGuard guard(stream_);
    e.start.record(stream_);
    dst.copy_(src, /*non_blocking=*/true);
    e.end.record(stream_);
  } catch (...) {
    pending_.pop_back();
    throw;
  }
  // Memory freed by the caller while the copy runs must not be handed out again (on the caller's stream) before the
  // copy ends: the caching allocator then waits for this stream too.
  for (const at::Tensor* t : {&dst, &src}) {
    if (t->is_cuda()) c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), stream_);
  }
  return ++issued_;
}

template <typename Done>
void CudaCopyQueue::retire_while(Done done) {
  while (!pending_.empty() && done(pending_.front())) {
    Entry& e = pending_.front();
    e.end.synchronize();  // done() may only have checked the ticket: the timing needs both events complete
    bytes_ += e.bytes;
    seconds_ += e.start.seconds_to(e.end);
    pending_.pop_front();
  }
}

void CudaCopyQueue::synchronize(int64_t ticket) {
  if (ticket <= 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK_VALUE(ticket <= issued_, "CudaCopyQueue.synchronize: ticket ", ticket, " was never issued (last is ",
                    issued_, "); pass a ticket returned by copy()");
  // One stream runs the copies in order: the wait on the newest entry <= ticket covers all earlier ones.
  for (auto it = pending_.rbegin(); it != pending_.rend(); ++it) {
    if (it->ticket <= ticket) {
      it->end.synchronize();
      break;
    }
  }
  retire_while([ticket](Entry& e) { return e.ticket <= ticket; });
}

void CudaCopyQueue::current_stream_wait(int64_t ticket) {
  if (ticket <= 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = pending_.rbegin(); it != pending_.rend(); ++it) {
    if (it->ticket <= ticket) {
      it->end.block(c10::cuda::getCurrentCUDAStream(device_.index()));
      return;
    }
  }
  // Not pending: already retired, so finished.
}

int64_t CudaCopyQueue::last_ticket() const {
  std::lock_guard<std::mutex> lock(mu_);
  return issued_;
}

std::pair<int64_t, double> CudaCopyQueue::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  retire_while([](Entry& e) { return e.end.query(); });
  return {bytes_, seconds_};
}

void CudaCopyQueue::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  retire_while([](Entry& e) { return e.end.query(); });
  bytes_ = 0;
  seconds_ = 0.0;
}

}  // namespace zeroshard

#endif  // ZEROSHARD_WITH_CUDA
