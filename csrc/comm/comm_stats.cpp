#include "comm/comm_stats.h"

#include <utility>

namespace zeroshard {

const char* collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllReduce:
      return "all_reduce";
  }
  return "unknown";
}

CollectiveCounters& CollectiveCounters::operator+=(const CollectiveCounters& o) {
  calls += o.calls;
  tensor_bytes += o.tensor_bytes;
  bytes += o.bytes;
  wire_bytes += o.wire_bytes;
  return *this;
}

CommStats::CommStats(std::string backend, int64_t world_size) : backend_(std::move(backend)), world_size_(world_size) {
  reset();
}

int64_t CommStats::ring_bytes(CollectiveKind kind, int64_t tensor_bytes, int64_t world_size) {
  if (world_size <= 1) return 0;
  const int64_t factor = kind == CollectiveKind::kAllReduce ? 2 : 1;
  return factor * tensor_bytes * (world_size - 1) / world_size;
}

int64_t CommStats::wire_bytes(const std::string& backend, CollectiveKind kind, int64_t tensor_bytes,
                              int64_t world_size) {
  if (backend != "gloo") return -1;
  return ring_bytes(kind, tensor_bytes, world_size);
}

void CommStats::record(CollectiveKind kind, int64_t tensor_bytes, std::optional<CollectiveKind> sent) {
  CollectiveCounters c;
  c.calls = 1;
  c.tensor_bytes = tensor_bytes;
  c.bytes = ring_bytes(kind, tensor_bytes, world_size_);
  c.wire_bytes = wire_known() ? wire_bytes(backend_, sent.value_or(kind), tensor_bytes, world_size_) : 0;
  std::lock_guard<std::mutex> lock(mu_);
  current_[static_cast<int>(kind)] += c;
}

void CommStats::end_step() {
  std::lock_guard<std::mutex> lock(mu_);
  last_ = current_;
  for (int k = 0; k < kNumCollectiveKinds; ++k) total_[k] += current_[k];
  current_ = CommCounters{};
  ++steps_;
}

void CommStats::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  current_ = last_ = total_ = CommCounters{};
  steps_ = 0;
}

CommCounters CommStats::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

CommCounters CommStats::last_step() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_;
}

CommCounters CommStats::total() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_;
}

int64_t CommStats::steps() const {
  std::lock_guard<std::mutex> lock(mu_);
  return steps_;
}

}  // namespace zeroshard
