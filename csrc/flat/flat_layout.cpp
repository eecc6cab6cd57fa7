#include "flat/flat_layout.h"

#include <c10/util/safe_numerics.h>

#include <algorithm>

namespace zeroshard {
namespace {

int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  TORCH_CHECK(!c10::mul_overflows(a, b, &out), "FlatParamLayout: ", what, " overflows int64");
  return out;
}

int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  TORCH_CHECK(!c10::add_overflows(a, b, &out), "FlatParamLayout: ", what, " overflows int64");
  return out;
}

int64_t round_up(int64_t x, int64_t m, const char* what) {
  return checked_mul((checked_add(x, m - 1, what)) / m, m, what);
}

}  // namespace

FlatParamLayout::FlatParamLayout(std::vector<std::vector<int64_t>> shapes, int64_t world_size, int64_t align_elems)
    : shapes_(std::move(shapes)), world_size_(world_size), align_elems_(align_elems) {
  TORCH_CHECK(world_size_ >= 1, "FlatParamLayout: world_size must be >= 1, got ", world_size_);
  TORCH_CHECK(align_elems_ >= 1, "FlatParamLayout: align_elems must be >= 1, got ", align_elems_);
  numels_.reserve(shapes_.size());
  offsets_.reserve(shapes_.size());
  int64_t cursor = 0;
  for (size_t i = 0; i < shapes_.size(); ++i) {
    int64_t numel = 1;
    for (size_t d = 0; d < shapes_[i].size(); ++d) {
      TORCH_CHECK(shapes_[i][d] >= 0, "FlatParamLayout: shapes[", i, "] has negative dim ", d, " = ", shapes_[i][d]);
      numel = checked_mul(numel, shapes_[i][d], "parameter numel");
    }
    const int64_t offset = round_up(cursor, align_elems_, "parameter offset");
    numels_.push_back(numel);
    offsets_.push_back(offset);
    cursor = checked_add(offset, numel, "flat size");
  }
  total_numel_ = cursor;
  padded_numel_ =
      round_up(total_numel_, checked_mul(world_size_, align_elems_, "world_size * align_elems"), "padded flat size");
}

std::pair<int64_t, int64_t> FlatParamLayout::shard_range(int64_t rank) const {
  TORCH_CHECK(rank >= 0 && rank < world_size_, "FlatParamLayout: rank ", rank, " out of range [0, ", world_size_, ")");
  return {rank * shard_numel(), (rank + 1) * shard_numel()};
}

std::vector<ShardSlice> FlatParamLayout::shard_slices(int64_t rank) const {
  const auto [begin, end] = shard_range(rank);
  std::vector<ShardSlice> out;
  for (int64_t i = 0; i < num_params(); ++i) {
    const int64_t lo = std::max(begin, offsets_[i]);
    const int64_t hi = std::min(end, offsets_[i] + numels_[i]);
    if (lo < hi) out.push_back({i, lo - offsets_[i], lo - begin, hi - lo});
  }
  return out;
}

void FlatParamLayout::check_flat(const at::Tensor& flat) const {
  TORCH_CHECK(flat.defined(), "FlatParamLayout: flat buffer is undefined");
  TORCH_CHECK(flat.dim() == 1, "FlatParamLayout: flat buffer must be 1-D, got shape ", flat.sizes());
  TORCH_CHECK(flat.is_contiguous(), "FlatParamLayout: flat buffer must be contiguous");
  TORCH_CHECK(flat.numel() == padded_numel_, "FlatParamLayout: flat buffer has ", flat.numel(),
              " elements, the layout needs padded_numel = ", padded_numel_);
}

void FlatParamLayout::check_tensors(const std::vector<at::Tensor>& tensors) const {
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == num_params(), "FlatParamLayout: got ", tensors.size(),
              " tensors for ", num_params(), " parameters");
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].defined(), "FlatParamLayout: tensors[", i, "] is undefined");
    TORCH_CHECK(tensors[i].sizes() == at::IntArrayRef(shapes_[i]), "FlatParamLayout: tensors[", i, "] has shape ",
                tensors[i].sizes(), ", the layout expects ", at::IntArrayRef(shapes_[i]));
  }
}

std::vector<at::Tensor> FlatParamLayout::views(const at::Tensor& flat) const {
  check_flat(flat);
  std::vector<at::Tensor> out;
  out.reserve(shapes_.size());
  for (size_t i = 0; i < shapes_.size(); ++i) out.push_back(flat.narrow(0, offsets_[i], numels_[i]).view(shapes_[i]));
  return out;
}

at::Tensor FlatParamLayout::flatten(const std::vector<at::Tensor>& tensors, std::optional<at::ScalarType> dtype,
                                    std::optional<at::Device> device) const {
  check_tensors(tensors);
  const at::ScalarType st = dtype.value_or(tensors.empty() ? at::kFloat : tensors[0].scalar_type());
  const at::Device dev = device.value_or(tensors.empty() ? at::Device(at::kCPU) : tensors[0].device());
  at::Tensor flat = at::zeros({padded_numel_}, at::TensorOptions().dtype(st).device(dev));
  copy_into(flat, tensors);
  return flat;
}

void FlatParamLayout::copy_into(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) const {
  check_tensors(tensors);
  const auto dst = views(flat);
  for (size_t i = 0; i < tensors.size(); ++i) dst[i].copy_(tensors[i]);
}

void FlatParamLayout::copy_out(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) const {
  check_tensors(tensors);
  const auto src = views(flat);
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].copy_(src[i]);
}

}  // namespace zeroshard
