// CopyQueue: copies that run asynchronously, in enqueue order, identified by increasing tickets. The offload pipeline
// uses one queue per direction (device -> host gradients, host -> device weights) so transfers overlap the CPU step.
// Backends: a worker thread doing memcpy (CPU), a dedicated CUDA stream (CUDA builds). Not thread-safe for several
// producers: one thread enqueues and waits; stats() may be called from any thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <utility>

namespace zeroshard {

class CopyQueue {
 public:
  virtual ~CopyQueue() = default;
  // The device whose copies this queue runs (CPU: host-to-host memcpy).
  virtual c10::Device device() const = 0;
  // Later copies start only after all work already issued on the caller's current CUDA stream (host queue: no-op,
  // program order already holds).
  virtual void wait_current_stream() = 0;
  // Enqueues dst <- src (same numel, same dtype, both contiguous; any devices the backend can copy between). Returns a
  // ticket, increasing from 1 per queue. Copies run in enqueue order. Both tensors are kept alive until the copy ends.
  // Throws at enqueue (nothing queued) when the arguments do not fit.
  virtual int64_t copy(const at::Tensor& dst, const at::Tensor& src) = 0;
  // Blocks the calling thread until copy `ticket` and every earlier one finished (ticket <= 0: returns at once).
  // Rethrows the error of a failed copy (host queue).
  virtual void synchronize(int64_t ticket) = 0;
  // The caller's current CUDA stream waits (device side, host not blocked) for copy `ticket`. Host queue: synchronize.
  virtual void current_stream_wait(int64_t ticket) = 0;
  virtual int64_t last_ticket() const = 0;
  // Bytes copied and seconds spent copying, over finished copies since the last reset (CUDA: event timing of each
  // copy on the queue's stream; host: wall time of each memcpy in the worker).
  virtual std::pair<int64_t, double> stats() = 0;
  virtual void reset_stats() = 0;
};

// CPU: a HostCopyQueue (one worker thread). CUDA (index or the current device): a CudaCopyQueue on a pool stream;
// throws in a build without CUDA parts.
std::shared_ptr<CopyQueue> make_copy_queue(c10::Device device);

// Argument checks shared by the backends: both defined, strided, contiguous, same dtype and numel. `queue` names the
// backend in the message.
void check_copy_args(const at::Tensor& dst, const at::Tensor& src, const char* queue);

}  // namespace zeroshard
