// GradBuffer: the full-size gradient accumulation buffer of one flat parameter, the input of its bucket's
// reduce-scatter (or all-reduce). It is allocated uninitialised and never zero-filled as a whole: the padding is zeroed
// at allocation (the reduction reads it), a parameter's first gradient is copied into its view and later ones are added
// (DDP's reducer copies a first gradient into its bucket the same way), and a view that no gradient reached is zeroed
// only when views() is asked for, just before the reduction reads the buffer.
#pragma once

#include "flat/flat_layout.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace zeroshard {

class GradBuffer {
 public:
  // layout: the flat parameter's layout; dtype / device: the buffer's (the reduce dtype, the parameters' device).
  GradBuffer(FlatParamLayout layout, at::ScalarType dtype, at::Device device);

  const FlatParamLayout& layout() const { return layout_; }
  bool allocated() const { return full_.defined(); }
  // The 1-D buffer of layout().padded_numel() elements, or an undefined tensor while not allocated.
  const at::Tensor& full() const { return full_; }

  // Adds grad (parameter index's shape, any floating dtype: converted as copy_ converts) into its view, allocating the
  // buffer on first use. Throws c10::Error naming the index or shape if either is wrong.
  void accumulate(int64_t index, const at::Tensor& grad);
  // Per-parameter views, allocating the buffer on first use; every element then reads as accumulated (zeros where no
  // gradient arrived since allocate or reset).
  const std::vector<at::Tensor>& views();
  // Stage 1 keeps its buffer across reductions: every view reads as zeros again, without writing the buffer.
  void reset();
  // Stages 2-3 after a reduction: the memory goes back; the next gradient allocates a fresh buffer.
  void release();
  // Parameters whose view is not written since allocate or reset (in index order).
  std::vector<int64_t> unwritten() const;
  // [begin, end) element ranges of the padding (before, between and after the parameters).
  const std::vector<std::pair<int64_t, int64_t>>& padding() const { return padding_; }

 private:
  void allocate();

  FlatParamLayout layout_;
  at::ScalarType dtype_;
  at::Device device_;
  std::vector<std::pair<int64_t, int64_t>> padding_;
  at::Tensor full_;
  std::vector<at::Tensor> views_;
  std::vector<bool> unwritten_;
  int64_t num_unwritten_ = 0;
};

}  // namespace zeroshard
