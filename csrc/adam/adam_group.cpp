#include "adam/adam_group.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>
#include <utility>

#include "adam/adam_detail.h"
#include "adam/adam_kernel.h"

namespace zeroshard {
namespace {

using adam_kernel::Args;

// torch's spelling of a dtype ("torch.float32"), the one a Python user types to fix it.
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

// [first byte, last byte + 1) of a contiguous tensor's data.
std::pair<uintptr_t, uintptr_t> byte_range(const at::Tensor& t) {
  const auto b = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {b, b + t.nbytes()};
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto [a0, a1] = byte_range(a);
  const auto [b0, b1] = byte_range(b);
  return a0 < b1 && b0 < a1 && a1 > a0 && b1 > b0;
}

// Device, layout and contiguity of one tensor; `what` names it fully.
void check_dense_cpu(const at::Tensor& t, const std::string& what, const char* fix_device) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), what, " is on ", t.device(), "; the fused CPU Adam steps CPU tensors only (",
                    fix_device, ")");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, what, " has layout ", t.layout(),
                    "; the fused CPU Adam needs dense tensors (sparse gradients: torch.optim.SparseAdam)");
  TORCH_CHECK_VALUE(t.is_contiguous(), what, " is not contiguous (strides ", t.strides(),
                    "); make it contiguous (no copy is made, the update is in place)");
}

}  // namespace

std::string AdamGroup::name(int64_t i) const {
  std::ostringstream s;
  s << label_ << " param " << i << " of group " << group_index_ << " (shape " << params_[i].sizes() << ")";
  return s.str();
}

AdamGroup::AdamGroup(std::vector<at::Tensor> params, std::vector<at::Tensor> exp_avgs,
                     std::vector<at::Tensor> exp_avg_sqs, std::string label, int64_t group_index,
                     std::vector<at::Tensor> exp_avg_absmaxes, std::vector<at::Tensor> exp_avg_sq_absmaxes)
    : params_(std::move(params)),
      exp_avgs_(std::move(exp_avgs)),
      exp_avg_sqs_(std::move(exp_avg_sqs)),
      m_absmax_(std::move(exp_avg_absmaxes)),
      v_absmax_(std::move(exp_avg_sq_absmaxes)),
      label_(std::move(label)),
      group_index_(group_index) {
  TORCH_CHECK_VALUE(exp_avgs_.size() == params_.size() && exp_avg_sqs_.size() == params_.size(), label_,
                    " param group ", group_index_, ": ", params_.size(), " params but ", exp_avgs_.size(),
                    " exp_avg and ", exp_avg_sqs_.size(), " exp_avg_sq tensors; pass one of each per param");
  TORCH_CHECK_VALUE((m_absmax_.empty() && v_absmax_.empty()) ||
                        (m_absmax_.size() == params_.size() && v_absmax_.size() == params_.size()),
                    label_, " param group ", group_index_, ": ", params_.size(), " params but ", m_absmax_.size(),
                    " exp_avg_absmax and ", v_absmax_.size(),
                    " exp_avg_sq_absmax entries; pass none, or one per param (undefined where the state is not int8)");
  state_types_.resize(params_.size());
  for (int64_t i = 0; i < size(); ++i) {
    const at::Tensor& p = params_[i];
    TORCH_CHECK_VALUE(p.defined(), label_, " param ", i, " of group ", group_index_, " is an undefined tensor");
    const std::string what = name(i);
    check_dense_cpu(p, what, "move the model to the CPU, or use a GPU optimizer");
    TORCH_CHECK_VALUE(p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16, what, " has dtype ",
                      dtype_name(p.scalar_type()), "; ", label_,
                      " steps torch.float32 (master) or torch.bfloat16 parameters: call .float() or .bfloat16()");
    const char* keys[] = {"exp_avg", "exp_avg_sq"};
    const at::Tensor* states[] = {&exp_avgs_[i], &exp_avg_sqs_[i]};
    for (int k = 0; k < 2; ++k) {
      const at::Tensor& s = *states[k];
      const std::string sw = std::string("state['") + keys[k] + "'] of " + what;
      TORCH_CHECK_VALUE(s.defined(), sw, " is missing; load a complete Adam/AdamW state_dict");
      check_dense_cpu(s, sw, "load the state_dict onto CPU parameters");
      TORCH_CHECK_VALUE(s.numel() == p.numel(), sw, " is ", dtype_name(s.scalar_type()), " with ", s.numel(),
                        " elements; expected ", p.numel());
      TORCH_CHECK_VALUE(!overlaps(s, p), sw, " shares memory with the parameter; each must be its own buffer");
    }
    TORCH_CHECK_VALUE(!overlaps(exp_avgs_[i], exp_avg_sqs_[i]), "state['exp_avg'] and state['exp_avg_sq'] of ", what,
                      " share memory; each must be its own buffer");
    const auto key = [&](const char* k) { return std::string("state['") + k + "'] of " + what; };
    const auto type = adam_detail::state_type_of(exp_avgs_[i], exp_avg_sqs_[i], exp_avg_absmax(i), exp_avg_sq_absmax(i),
                                                 p.numel(), key);
    state_types_[i] = static_cast<uint8_t>(type);
    if (type == adam_kernel::StateType::kInt8) {
      const at::Tensor* scales[] = {&m_absmax_[i], &v_absmax_[i]};
      const char* skeys[] = {"exp_avg_absmax", "exp_avg_sq_absmax"};
      for (int k = 0; k < 2; ++k) {
        check_dense_cpu(*scales[k], key(skeys[k]), "load the state_dict onto CPU parameters");
        for (const at::Tensor* t :
             std::initializer_list<const at::Tensor*>{&p, &exp_avgs_[i], &exp_avg_sqs_[i], scales[1 - k]}) {
          TORCH_CHECK_VALUE(!overlaps(*scales[k], *t), key(skeys[k]),
                            " shares memory with the parameter or its other state; each must be its own buffer");
        }
      }
    }
  }
}

void AdamGroup::check(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& steps,
                      const AdamHyper& hyper) const {
  TORCH_CHECK_VALUE(static_cast<int64_t>(grads.size()) == size() && static_cast<int64_t>(steps.size()) == size(),
                    label_, " param group ", group_index_, " has ", size(), " tensors but the step got ", grads.size(),
                    " gradients and ", steps.size(), " step counts");
  AdamHyper h = hyper;
  h.step = 1;
  try {
    adam_detail::check_hyper(h);
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(false, label_, " param group ", group_index_, ": ", e.what_without_backtrace());
  }
  for (int64_t i = 0; i < size(); ++i) {
    const at::Tensor& g = grads[i];
    if (!g.defined()) continue;
    TORCH_CHECK_VALUE(steps[i] >= 0, "state['step'] of ", name(i), " is ", steps[i], "; step counts are >= 0");
    if (g.device().is_cpu() && g.layout() == at::kStrided && g.is_contiguous() && g.numel() == params_[i].numel() &&
        (g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16 || g.scalar_type() == at::kHalf) &&
        !overlaps(g, params_[i]) && !overlaps(g, exp_avgs_[i]) && !overlaps(g, exp_avg_sqs_[i])) {
      continue;  // the common case, checked with no string built
    }
    const std::string what = "the gradient of " + name(i);
    check_dense_cpu(g, what, "gradients must live with their CPU parameter");
    const auto t = g.scalar_type();
    TORCH_CHECK_VALUE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, what, " has dtype ", dtype_name(t),
                      "; supported: torch.float32, torch.bfloat16, torch.float16");
    TORCH_CHECK_VALUE(g.numel() == params_[i].numel(), what, " has ", g.numel(), " elements, expected ",
                      params_[i].numel());
    TORCH_CHECK_VALUE(false, what, " shares memory with the parameter or its optimizer state; pass its own buffer");
  }
}

std::optional<GradStats> adam_step_groups(const std::vector<AdamGroupStep>& work, bool compute_grad_stats,
                                          std::optional<std::string_view> isa) {
  for (const AdamGroupStep& w : work) {
    TORCH_CHECK_VALUE(w.group != nullptr, "adam_step_groups: a work entry has no group");
    w.group->check(w.grads, w.steps, w.hyper);
  }
  const adam_kernel::KernelFn kernel = adam_detail::kernel_for(resolve_cpu_isa(isa));

  // One Args per stepped tensor, then its chunks.
  struct Chunk {
    int64_t arg, begin, end;
  };
  std::vector<Args> args;
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (const AdamGroupStep& w : work) {
    AdamHyper h = w.hyper;
    int64_t factors_step = -1;
    adam_kernel::Factors f;
    for (int64_t i = 0; i < w.group->size(); ++i) {
      const at::Tensor& g = w.grads[i];
      if (!g.defined()) continue;
      if (w.steps[i] + 1 != factors_step) {  // usually one step count for the whole group
        factors_step = h.step = w.steps[i] + 1;
        f = adam_detail::make_factors(h);
      }
      Args a;
      const at::Tensor& p = w.group->param(i);
      a.param = p.data_ptr();
      a.param_type =
          p.scalar_type() == at::kBFloat16 ? adam_kernel::ParamType::kBFloat16 : adam_kernel::ParamType::kFloat32;
      a.exp_avg = w.group->exp_avg(i).data_ptr();
      a.exp_avg_sq = w.group->exp_avg_sq(i).data_ptr();
      adam_detail::set_state(a, static_cast<adam_kernel::StateType>(w.group->state_type(i)), w.group->exp_avg_absmax(i),
                             w.group->exp_avg_sq_absmax(i));
      a.grad = g.data_ptr();
      a.grad_type = adam_detail::grad_type_of(g);
      a.prefetch_elems = adam_detail::prefetch_elems();
      a.f = f;
      const int64_t n = g.numel();
      for (int64_t b = 0; b < n; b += kAdamChunk) {
        chunks.push_back({static_cast<int64_t>(args.size()), b, std::min(n, b + kAdamChunk)});
      }
      args.push_back(a);
      total += n;
    }
  }
  std::vector<double> partial(compute_grad_stats ? chunks.size() : 0, 0.0);
  const auto run = [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const Chunk& k = chunks[c];
      const double s = kernel(args[k.arg], k.begin, k.end, compute_grad_stats);
      if (compute_grad_stats) partial[c] = s;
    }
  };
  const auto n_chunks = static_cast<int64_t>(chunks.size());
  if (total < kAdamChunk) {
    run(0, n_chunks);  // too little work to wake a second thread for
  } else {
    // Each thread takes at least about kAdamChunk elements of many small tensors.
    const int64_t grain = std::max<int64_t>(1, n_chunks * kAdamChunk / (2 * total));
    at::parallel_for(0, n_chunks, grain, run);
  }
  for (const AdamGroupStep& w : work) {
    for (int64_t i = 0; i < w.group->size(); ++i) {
      if (!w.grads[i].defined()) continue;
      adam_detail::bump_version(w.group->param(i));
      adam_detail::bump_version(w.group->exp_avg(i));
      adam_detail::bump_version(w.group->exp_avg_sq(i));
      if (w.group->state_type(i) == static_cast<uint8_t>(adam_kernel::StateType::kInt8)) {
        adam_detail::bump_version(*w.group->exp_avg_absmax(i));
        adam_detail::bump_version(*w.group->exp_avg_sq_absmax(i));
      }
    }
  }
  if (!compute_grad_stats) return std::nullopt;
  GradStats stats;
  for (double s : partial) stats.grad_sq_sum += s;
  stats.found_inf = !std::isfinite(stats.grad_sq_sum);
  return stats;
}

}  // namespace zeroshard
