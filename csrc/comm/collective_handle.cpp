#include "comm/collective_handle.h"

namespace zeroshard {

void CollectiveHandle::wait() {
  if (error_) std::rethrow_exception(error_);
  if (done_) return;
  try {
    for (auto& w : works_) w->wait();
    for (auto& f : finishers_) f();
  } catch (...) {
    error_ = std::current_exception();
    throw;
  }
  done_ = true;
  // Drop the staging buffers now rather than when the handle dies.
  works_.clear();
  finishers_.clear();
}

bool CollectiveHandle::is_completed() const {
  if (done_) return true;
  for (const auto& w : works_) {
    if (!w->isCompleted()) return false;
  }
  return true;
}

}  // namespace zeroshard
