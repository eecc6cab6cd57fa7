#include "grad/grad_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace zeroshard {

namespace {

// Runs after AccumulateGrad has put the parameter's gradient into .grad.
struct AccumulatedHook : torch::autograd::FunctionPostHook {
  AccumulatedHook(GradHooks* owner, int64_t f, int64_t i) : owner(owner), f(f), i(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    owner->on_grad(f, i);
    return outputs;
  }
  GradHooks* owner;
  int64_t f;
  int64_t i;
};

}  // namespace

GradHooks::GradHooks(std::vector<std::vector<at::Tensor>> params, std::vector<std::shared_ptr<GradBuffer>> buffers,
                     OnFirst on_first, OnComplete on_complete)
    : params_(std::move(params)),
      buffers_(std::move(buffers)),
      on_first_(std::move(on_first)),
      on_complete_(std::move(on_complete)) {
  TORCH_CHECK(params_.size() == buffers_.size(), "GradHooks: ", params_.size(), " parameter lists but ",
              buffers_.size(), " gradient buffers");
  for (size_t f = 0; f < params_.size(); ++f) {
    TORCH_CHECK(buffers_[f] != nullptr, "GradHooks: gradient buffer ", f, " is None");
    TORCH_CHECK(static_cast<int64_t>(params_[f].size()) == buffers_[f]->layout().num_params(), "GradHooks: flat ",
                "parameter ", f, " has ", params_[f].size(), " parameters but its buffer's layout has ",
                buffers_[f]->layout().num_params());
    reported_.emplace_back(params_[f].size(), false);
    reported_count_.push_back(0);
    used_.emplace_back(params_[f].size(), false);
  }
  for (size_t f = 0; f < params_.size(); ++f) {
    for (size_t i = 0; i < params_[f].size(); ++i) {
      const at::Tensor& p = params_[f][i];
      TORCH_CHECK(p.defined() && p.is_leaf() && p.requires_grad(), "GradHooks: parameter ", i, " of flat parameter ", f,
                  " is not a leaf tensor that requires grad");
      NodePtr acc = torch::autograd::impl::grad_accumulator(p);
      TORCH_CHECK(acc, "GradHooks: parameter ", i, " of flat parameter ", f, " has no gradient accumulator");
      const uintptr_t key = acc->add_post_hook(std::make_unique<AccumulatedHook>(this, f, i));
      hooked_.emplace_back(std::move(acc), key);
    }
  }
}

GradHooks::~GradHooks() { remove(); }

void GradHooks::remove() {
  for (auto& [acc, key] : hooked_) acc->del_post_hook(key);
  hooked_.clear();
}

void GradHooks::on_grad(int64_t f, int64_t i) {
  if (!active_) {
    active_ = true;
    on_first_();
  }
  at::Tensor& slot = params_[f][i].mutable_grad();
  if (!slot.defined()) return;
  const at::Tensor grad = std::move(slot);
  slot = at::Tensor();
  {
    // only a create_graph backward runs hooks in grad mode: the buffer stays out of its graph
    at::NoGradGuard no_grad;
    buffers_[f]->accumulate(i, grad);
  }
  used_[f][i] = true;
  if (reported_[f][i]) return;  // a second gradient for one parameter in one backward (reentrant use): counted once
  reported_[f][i] = true;
  if (++reported_count_[f] == static_cast<int64_t>(reported_[f].size())) on_complete_(f);
}

void GradHooks::reset_reported() {
  for (size_t f = 0; f < reported_.size(); ++f) {
    reported_[f].assign(reported_[f].size(), false);
    reported_count_[f] = 0;
  }
}

std::vector<int64_t> GradHooks::take_used(int64_t f) {
  std::vector<int64_t> out;
  auto& used = used_.at(f);
  for (size_t i = 0; i < used.size(); ++i) {
    if (used[i]) out.push_back(static_cast<int64_t>(i));
  }
  used.assign(used.size(), false);
  return out;
}

}  // namespace zeroshard
