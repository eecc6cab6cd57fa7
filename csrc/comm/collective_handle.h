// CollectiveHandle: the in-flight part of a bucketed collective. Holds the c10d works, the staging buffers (through
// the finishers' captures) and the unpack / scale / accumulate steps that may only run once the works are done.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <exception>
#include <functional>
#include <vector>

namespace zeroshard {

class CollectiveHandle {
 public:
  CollectiveHandle() = default;  // nothing in flight: wait() returns at once
  CollectiveHandle(CollectiveHandle&&) = default;
  CollectiveHandle& operator=(CollectiveHandle&&) = default;
  CollectiveHandle(const CollectiveHandle&) = delete;
  CollectiveHandle& operator=(const CollectiveHandle&) = delete;

  // Waits for every work, then runs the finishers in order. Results are only visible after this returns. On CUDA the
  // wait only orders the current stream after the collectives (no host sync) and the finishers are enqueued on it.
  // A second call is a no-op; if the first call threw, later calls rethrow the same error.
  void wait();
  // True once every collective has finished (wait() will not block on the network) or wait() has run. The unpack
  // steps have not necessarily run: call wait() before reading the outputs.
  bool is_completed() const;

  void add_work(c10::intrusive_ptr<c10d::Work> work) { works_.push_back(std::move(work)); }
  void add_finisher(std::function<void()> fn) { finishers_.push_back(std::move(fn)); }
  int64_t num_works() const { return static_cast<int64_t>(works_.size()); }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::vector<std::function<void()>> finishers_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace zeroshard
