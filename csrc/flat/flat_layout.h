// FlatParamLayout: where each parameter of a unit (or bucket) lives inside one padded 1-D flat buffer, and which part
// of that buffer each rank owns. Every piece of sharded state (compute params, grads, fp32 master, Adam moments) uses
// the same layout, so one shard_range / shard_slices answer serves all of them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace zeroshard {

// One contiguous piece of one parameter that falls inside one rank's shard. All offsets and counts are in elements.
struct ShardSlice {
  int64_t param_index;   // which parameter (index into shapes())
  int64_t param_offset;  // offset inside the flattened parameter
  int64_t shard_offset;  // offset inside the rank's shard
  int64_t numel;         // length of the piece (> 0)

  bool operator==(const ShardSlice& o) const {
    return param_index == o.param_index && param_offset == o.param_offset && shard_offset == o.shard_offset &&
           numel == o.numel;
  }
};

class FlatParamLayout {
 public:
  // shapes: one shape per parameter (an empty shape is a scalar, a zero dim is an empty parameter).
  // world_size >= 1 ranks; align_elems >= 1: every parameter starts at a multiple of it (pass at least 64 bytes /
  // element size so each view is vector-aligned). The buffer is padded to a multiple of world_size * align_elems, so
  // every shard has the same size and starts aligned too.
  FlatParamLayout(std::vector<std::vector<int64_t>> shapes, int64_t world_size, int64_t align_elems);

  int64_t world_size() const { return world_size_; }
  int64_t align_elems() const { return align_elems_; }
  int64_t num_params() const { return static_cast<int64_t>(shapes_.size()); }
  const std::vector<std::vector<int64_t>>& shapes() const { return shapes_; }
  const std::vector<int64_t>& numels() const { return numels_; }
  const std::vector<int64_t>& offsets() const { return offsets_; }
  int64_t total_numel() const { return total_numel_; }    // end of the last parameter, before padding
  int64_t padded_numel() const { return padded_numel_; }  // size of the flat buffer
  int64_t shard_numel() const { return padded_numel_ / world_size_; }

  // [begin, end) of rank's shard inside the flat buffer.
  std::pair<int64_t, int64_t> shard_range(int64_t rank) const;
  // Every parameter piece inside rank's shard, in parameter order. Across all ranks these cover each element of each
  // parameter exactly once. Padding is not listed.
  std::vector<ShardSlice> shard_slices(int64_t rank) const;

  // Per-parameter views (flat.narrow(...).view(shape)) into a 1-D contiguous buffer of padded_numel() elements.
  std::vector<at::Tensor> views(const at::Tensor& flat) const;
  // A new flat buffer holding the tensors (shapes must match), zero padding. dtype / device default to tensors[0]'s
  // (float / CPU when there are no parameters).
  at::Tensor flatten(const std::vector<at::Tensor>& tensors, std::optional<at::ScalarType> dtype = std::nullopt,
                     std::optional<at::Device> device = std::nullopt) const;
  // tensors -> flat (padding is left untouched); flat -> tensors. Both convert dtype / device as copy_ does.
  void copy_into(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) const;
  void copy_out(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) const;

 private:
  void check_flat(const at::Tensor& flat) const;
  void check_tensors(const std::vector<at::Tensor>& tensors) const;

  std::vector<std::vector<int64_t>> shapes_;
  int64_t world_size_;
  int64_t align_elems_;
  std::vector<int64_t> numels_;
  std::vector<int64_t> offsets_;
  int64_t total_numel_ = 0;
  int64_t padded_numel_ = 0;
};

}  // namespace zeroshard
