// GradHooks: moves every parameter's gradient into its flat parameter's GradBuffer as autograd produces it, and says
// when a flat parameter has all its gradients. One post hook per parameter on its gradient accumulator (the
// AccumulateGrad node), as DDP's C++ reducer hooks its buckets: the hook takes .grad (leaving it undefined), adds it
// into the buffer and counts it. The caller hears once per backward (the first gradient) and once per complete flat
// parameter, instead of once per parameter (issue 22: a Python post-accumulate-grad hook cost ~22 us per parameter).
//
// Hooks run on the autograd engine's thread for the parameters' device; the callbacks are called there too and may
// throw (the exception ends the backward, as a hook's would).
#pragma once

#include "grad/grad_buffer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace zeroshard {

class GradHooks {
 public:
  using OnFirst = std::function<void()>;            // the first gradient of a backward (before it is accumulated)
  using OnComplete = std::function<void(int64_t)>;  // flat parameter f has a gradient for every parameter

  // params[f]: the parameters of flat parameter f, in its layout's order (leaf tensors that require grad);
  // buffers[f]: its gradient buffer. Throws c10::Error if the counts differ or a parameter is not such a leaf.
  GradHooks(std::vector<std::vector<at::Tensor>> params, std::vector<std::shared_ptr<GradBuffer>> buffers,
            OnFirst on_first, OnComplete on_complete);
  ~GradHooks();
  GradHooks(const GradHooks&) = delete;
  GradHooks& operator=(const GradHooks&) = delete;

  // The hook body for parameter i of flat parameter f (public so the tests can drive it without autograd).
  void on_grad(int64_t f, int64_t i);
  // Removes every hook (also done by the destructor); idempotent.
  void remove();

  // Whether a backward has started (a first gradient arrived) and not been ended by the caller.
  bool active() const { return active_; }
  void set_active(bool value) { active_ = value; }
  // Whether flat parameter f has reported every parameter since reset_reported().
  bool complete(int64_t f) const { return reported_count_.at(f) == static_cast<int64_t>(reported_.at(f).size()); }
  void reset_reported();
  // Parameters of flat parameter f that got a gradient since the last take_used(f); clears the record.
  std::vector<int64_t> take_used(int64_t f);
  int64_t num_flat_params() const { return static_cast<int64_t>(params_.size()); }

 private:
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

  std::vector<std::vector<at::Tensor>> params_;
  std::vector<std::shared_ptr<GradBuffer>> buffers_;
  OnFirst on_first_;
  OnComplete on_complete_;
  std::vector<std::pair<NodePtr, uintptr_t>> hooked_;  // each accumulator (kept alive, as DDP does) and its hook key
  std::vector<std::vector<bool>> reported_;
  std::vector<int64_t> reported_count_;
  std::vector<std::vector<bool>> used_;
  bool active_ = false;
};

}  // namespace zeroshard
