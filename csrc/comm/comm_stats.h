// CommStats: bytes this rank sends through each kind of collective, per step and in total.
//
// What is counted is what we ask of the process group, in the volume a ring algorithm sends per rank (the
// algorithm NCCL uses for large messages, and what the ZeRO paper's volumes assume; Rajbhandari et al. 2020, section
// 7): for a full buffer of F bytes over N ranks, all-gather and reduce-scatter send F (N-1)/N, all-reduce 2 F (N-1)/N.
// nccl-tests' "bus bandwidth" is defined so that these bytes divided by it give the collective's time.
//
// Separately, `wire_bytes` is what the backend really sends where we know it: gloo runs all-gather, all-reduce and
// all-to-all with ring volumes (measured through the bytes its sockets write; benchmarks/bench_comm_volume.py). Our
// reduce-scatter on gloo is an all-to-all of the chunks (F (N-1)/N); gloo's own reduce-scatter, used only for CUDA
// tensors, all-reduces the full buffer (2 F (N-1)/N), and is recorded as sent by an all-reduce. For other backends
// wire_known() is false and wire_bytes stays 0.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

namespace zeroshard {

enum class CollectiveKind : int { kAllGather = 0, kReduceScatter = 1, kAllReduce = 2 };
constexpr int kNumCollectiveKinds = 3;
const char* collective_kind_name(CollectiveKind kind);

struct CollectiveCounters {
  int64_t calls = 0;         // collectives launched (one per non-empty bucket)
  int64_t tensor_bytes = 0;  // full-buffer bytes (the gathered / pre-reduce tensor), nccl-tests' "size"
  int64_t bytes = 0;         // bytes this rank sends, ring volume (see above)
  int64_t wire_bytes = 0;    // bytes the backend really sends (0 when !CommStats::wire_known())

  CollectiveCounters& operator+=(const CollectiveCounters& o);
};

using CommCounters = std::array<CollectiveCounters, kNumCollectiveKinds>;

class CommStats {
 public:
  // backend: the process group's backend name ("gloo", "nccl", ...), which decides wire_bytes; world_size: its ranks.
  CommStats(std::string backend, int64_t world_size);

  // One collective of `kind` over a full buffer of `tensor_bytes` bytes (thread-safe); `sent`: the collective the
  // backend runs for it, when another (gloo's reduce-scatter of CUDA tensors is an all-reduce), for wire_bytes.
  void record(CollectiveKind kind, int64_t tensor_bytes, std::optional<CollectiveKind> sent = std::nullopt);
  // Closes the current step: its counters become last_step() and are added to total().
  void end_step();
  // Forgets everything (steps, totals, the open step).
  void reset();

  CommCounters current() const;    // since the last end_step()
  CommCounters last_step() const;  // the step closed by the last end_step()
  CommCounters total() const;      // every closed step
  int64_t steps() const;
  const std::string& backend() const { return backend_; }
  bool wire_known() const { return backend_ == "gloo"; }
  int64_t world_size() const { return world_size_; }

  // Ring bytes one rank sends for `kind` over `tensor_bytes` on `world_size` ranks; and what `backend` puts on the
  // wire when it runs `kind` itself (-1 if unknown).
  static int64_t ring_bytes(CollectiveKind kind, int64_t tensor_bytes, int64_t world_size);
  static int64_t wire_bytes(const std::string& backend, CollectiveKind kind, int64_t tensor_bytes, int64_t world_size);

 private:
  std::string backend_;
  int64_t world_size_;
  mutable std::mutex mu_;
  CommCounters current_{};
  CommCounters last_{};
  CommCounters total_{};
  int64_t steps_ = 0;
};

}  // namespace zeroshard
