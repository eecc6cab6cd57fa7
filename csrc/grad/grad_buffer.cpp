#include "grad/grad_buffer.h"

#include <algorithm>

namespace zeroshard {

GradBuffer::GradBuffer(FlatParamLayout layout, at::ScalarType dtype, at::Device device)
    : layout_(std::move(layout)), dtype_(dtype), device_(device) {
  int64_t pos = 0;  // parameters may share elements only if empty; the padding is what no parameter covers
  for (int64_t i = 0; i < layout_.num_params(); ++i) {
    const int64_t off = layout_.offsets()[i];
    if (off > pos) padding_.emplace_back(pos, off);
    pos = std::max(pos, off + layout_.numels()[i]);
  }
  if (layout_.padded_numel() > pos) padding_.emplace_back(pos, layout_.padded_numel());
}

void GradBuffer::allocate() {
  full_ = at::empty({layout_.padded_numel()}, at::TensorOptions().dtype(dtype_).device(device_));
  for (const auto& [begin, end] : padding_) full_.narrow(0, begin, end - begin).zero_();
  views_ = layout_.views(full_);
  unwritten_.assign(layout_.num_params(), true);
  num_unwritten_ = layout_.num_params();
}

void GradBuffer::accumulate(int64_t index, const at::Tensor& grad) {
  TORCH_CHECK(index >= 0 && index < layout_.num_params(), "GradBuffer.accumulate: parameter index ", index,
              " is out of range for ", layout_.num_params(), " parameters");
  TORCH_CHECK(grad.sizes() == at::IntArrayRef(layout_.shapes()[index]), "GradBuffer.accumulate: the gradient of ",
              "parameter ", index, " has shape ", grad.sizes(), ", expected ",
              at::IntArrayRef(layout_.shapes()[index]));
  if (!full_.defined()) allocate();
  if (unwritten_[index]) {
    views_[index].copy_(grad);
    unwritten_[index] = false;
    --num_unwritten_;
  } else {
    views_[index].add_(grad);
  }
}

const std::vector<at::Tensor>& GradBuffer::views() {
  if (!full_.defined()) allocate();
  if (num_unwritten_ > 0) {
    for (size_t i = 0; i < views_.size(); ++i) {
      if (unwritten_[i]) {
        views_[i].zero_();
        unwritten_[i] = false;
      }
    }
    num_unwritten_ = 0;
  }
  return views_;
}

void GradBuffer::reset() {
  if (!full_.defined()) return;
  unwritten_.assign(layout_.num_params(), true);
  num_unwritten_ = layout_.num_params();
}

void GradBuffer::release() {
  full_ = at::Tensor();
  views_.clear();
  unwritten_.clear();
  num_unwritten_ = 0;
}

std::vector<int64_t> GradBuffer::unwritten() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < unwritten_.size(); ++i) {
    if (unwritten_[i]) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

}  // namespace zeroshard
