// BucketedCollectives: all-gather / reduce-scatter / all-reduce of many tensors over one c10d::ProcessGroup (NCCL on
// CUDA, gloo on CPU), grouping consecutive tensors into buckets so that each bucket is one collective.
//
// Bucketing: tensors are taken in order; a bucket closes when adding the next tensor would make its full-buffer size
// (the gathered / pre-reduce tensor, in elements) exceed bucket_elems. A tensor larger than bucket_elems gets a bucket
// of its own. A bucket of one tensor runs the collective on the caller's tensors directly (no staging copy); a bucket
// of several packs them into one staging buffer and unpacks after the wait (FSDP2's copy-in / copy-out).
//
// Every rank must call the same ops with the same sizes, dtypes and bucket_elems in the same order, as with any
// collective. Everything is validated before anything is launched, so a bad call throws on every rank without leaving
// a collective half-issued. All ops are asynchronous: they return a CollectiveHandle, and outputs are only valid after
// handle.wait(). Inputs and outputs must stay alive and untouched until then. Every launched collective is counted in
// stats() (comm/comm_stats.h): calls and bytes per kind, per step and in total.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/collective_handle.h"
#include "comm/comm_stats.h"

#include <memory>
#include <vector>

namespace zeroshard {

class BucketedCollectives {
 public:
  explicit BucketedCollectives(c10::intrusive_ptr<c10d::ProcessGroup> pg);

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return pg_; }
  // Bytes and calls of every collective launched through this object (shared, so it outlives handles and copies).
  const std::shared_ptr<CommStats>& stats() const { return stats_; }

  // fulls[i] (any shape, world_size * shards[i].numel() elements) <- concatenation over ranks of shards[i].
  // All tensors contiguous, one dtype, one device. shards[i] may be the view fulls[i].flatten().narrow(0, rank * S, S)
  // (in-place all-gather).
  CollectiveHandle all_gather(std::vector<at::Tensor> shards, std::vector<at::Tensor> fulls, int64_t bucket_elems);

  // shards[i] (= or +=, when accumulate) scale * (SUM over ranks of chunk `rank` of fulls[i]), where fulls[i] is seen
  // as [world_size, shards[i].numel()]. Reduces with SUM and scales locally (never ReduceOp AVG; pass 1/world_size for
  // a mean). fulls share one dtype, shards share one dtype which may differ (e.g. bf16 fulls, fp32 shards): the sum is
  // computed in the fulls' dtype, the scale and accumulate in the shards' dtype. fulls may be overwritten (NCCL may
  // reduce in place). On gloo with CPU tensors it runs as an all-to-all of the chunks into a [world_size, S] buffer
  // and a local sum in rank order after the wait (gloo's own reduce-scatter all-reduces the whole input).
  CollectiveHandle reduce_scatter(std::vector<at::Tensor> fulls, std::vector<at::Tensor> shards, int64_t bucket_elems,
                                  double scale, bool accumulate);

  // tensors[i] <- scale * SUM over ranks of tensors[i], in place. One dtype, one device, contiguous.
  CollectiveHandle all_reduce(std::vector<at::Tensor> tensors, int64_t bucket_elems, double scale);

  // [begin, end) index ranges of the buckets for these per-tensor full-buffer sizes (exposed for tests and planning).
  static std::vector<std::pair<size_t, size_t>> plan_buckets(const std::vector<int64_t>& full_numels,
                                                             int64_t bucket_elems);

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int64_t rank_;
  int64_t world_size_;
  bool gloo_;  // CPU tensors reduce-scatter as an all-to-all plus a local sum
  std::shared_ptr<CommStats> stats_;
};

}  // namespace zeroshard
