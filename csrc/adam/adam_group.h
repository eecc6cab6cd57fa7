// AdamGroup: the tensors of one optimizer param group, validated once, then stepped many times in one call.
//
// A torch optimizer steps a list of tensors per param group. Checking every tensor on every step (device, layout,
// dtype, size, aliasing) and entering the kernel once per tensor costs microseconds per tensor, which on a model of
// hundreds of small tensors is more than the arithmetic. Here the parameters and their moments are checked once when
// the group is built; each step checks only what changes between steps (the gradients: cheap pointer and size tests)
// and runs every tensor's chunks in one parallel loop.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "adam/adam.h"

namespace zeroshard {

class AdamGroup {
 public:
  // params, exp_avgs, exp_avg_sqs: one entry per tensor of the group, CPU, dense, contiguous; the three of one
  // tensor have the same numel and share no memory. params fp32 (or bf16, no master); each tensor's moments in one
  // state format told by dtype (adam_state_format.h), formats may differ between tensors. exp_avg_absmaxes /
  // exp_avg_sq_absmaxes: empty, or one entry per tensor, defined for the int8 ones (fp32, ceil(numel / 2048)
  // elements). label names the owner in errors ("CPUAdam"), group_index the param group. Throws c10::ValueError
  // (c10::TypeError for a state dtype) naming "<label> param <i> of group <g> (shape [...])" and the fix.
  AdamGroup(std::vector<at::Tensor> params, std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
            std::string label, int64_t group_index, std::vector<at::Tensor> exp_avg_absmaxes = {},
            std::vector<at::Tensor> exp_avg_sq_absmaxes = {});

  int64_t size() const { return static_cast<int64_t>(params_.size()); }

  // Checks grads (one per tensor; undefined = tensor skipped this step) and steps (one per tensor: the count *before*
  // this step, >= 0) against this group, and hyper (its step field is ignored). Throws c10::ValueError naming the
  // tensor; writes nothing.
  void check(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& steps, const AdamHyper& hyper) const;

  const at::Tensor& param(int64_t i) const { return params_[i]; }
  const at::Tensor& exp_avg(int64_t i) const { return exp_avgs_[i]; }
  const at::Tensor& exp_avg_sq(int64_t i) const { return exp_avg_sqs_[i]; }
  // The int8 scales of tensor i (null unless its state is int8) and its state format.
  const at::Tensor* exp_avg_absmax(int64_t i) const { return m_absmax_.empty() ? nullptr : &m_absmax_[i]; }
  const at::Tensor* exp_avg_sq_absmax(int64_t i) const { return v_absmax_.empty() ? nullptr : &v_absmax_[i]; }
  uint8_t state_type(int64_t i) const { return state_types_[i]; }
  std::string name(int64_t i) const;

 private:
  std::vector<at::Tensor> params_, exp_avgs_, exp_avg_sqs_, m_absmax_, v_absmax_;
  std::vector<uint8_t> state_types_;  // adam_kernel::StateType per tensor
  std::string label_;
  int64_t group_index_;
};

// One group's work for adam_step_groups.
struct AdamGroupStep {
  const AdamGroup* group = nullptr;
  std::vector<at::Tensor> grads;  // per tensor; undefined = skip
  std::vector<int64_t> steps;     // per tensor, the count before this step; each stepped tensor uses steps[i] + 1
  AdamHyper hyper;                // step field ignored
};

// Steps every group: all are checked first (nothing is written if one check fails), then every stepped tensor's
// kAdamChunk-element chunks run in one at::parallel_for, each with adam_step's kernel and numerics (so results equal
// one adam_step call per tensor bit for bit, for any thread count). Returns the gradient statistics over all stepped
// tensors (chunk partial sums added in group, tensor, chunk order) if compute_grad_stats, else nullopt.
std::optional<GradStats> adam_step_groups(const std::vector<AdamGroupStep>& work, bool compute_grad_stats = false,
                                          std::optional<std::string_view> isa = std::nullopt);

}  // namespace zeroshard
