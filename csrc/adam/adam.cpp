#include "adam/adam.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "adam/adam_cuda.h"
#include "adam/adam_detail.h"
#include "adam/adam_kernel.h"

namespace zeroshard {
namespace adam_detail {

using adam_kernel::Args;
using adam_kernel::Factors;
using adam_kernel::GradType;
using adam_kernel::KernelFn;
using adam_kernel::OutType;
using adam_kernel::StateType;

// The device of one step: the CPU, or param's CUDA device where this build has the CUDA kernel (adam_cuda.h).
c10::Device step_device(const at::Tensor& param) {
  if (!param.defined() || !param.is_cuda()) return c10::Device(c10::kCPU);
  TORCH_CHECK(cuda_step_available(), "adam_step: param is on ", param.device(),
              "; this build of zeroshard has no CUDA parts (built against a CPU-only torch, or without nvcc): ",
              "rebuild it with a CUDA torch and nvcc, or step CPU tensors");
  return param.device();
}

void check_tensor(const at::Tensor& t, const char* name, const c10::Device& device = c10::Device(c10::kCPU)) {
  TORCH_CHECK(t.defined(), "adam_step: ", name, " is an undefined tensor; pass a ", device.is_cpu() ? "CPU" : "CUDA",
              " tensor");
  if (device.is_cpu()) {
    TORCH_CHECK(t.device().is_cpu(), "adam_step: ", name, " is on ", t.device(),
                "; the fused CPU Adam needs CPU tensors (move it with .cpu(), or use a GPU optimizer)");
  } else {
    TORCH_CHECK(t.device() == device, "adam_step: ", name, " is on ", t.device(), " and param on ", device,
                "; keep every tensor of one step on param's device");
  }
  TORCH_CHECK(t.layout() == at::kStrided, "adam_step: ", name, " has layout ", t.layout(),
              "; only dense (strided) tensors are supported (convert with .to_dense())");
  TORCH_CHECK(t.is_contiguous(), "adam_step: ", name, " is not contiguous (sizes ", t.sizes(), ", strides ",
              t.strides(), "); pass a contiguous tensor (e.g. keep optimizer state in .contiguous() buffers). ",
              "No silent copy is made, since the update is in place");
}

void check_numel(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK_VALUE(t.numel() == n, "adam_step: ", name, " has ", t.numel(), " elements but param has ", n,
                    "; all tensors of one step must have the same number of elements");
}

void check_no_overlap(const at::Tensor& a, const char* an, const at::Tensor& b, const char* bn) {
  const auto s = at::get_overlap_status(a, b);
  TORCH_CHECK(s == at::MemOverlapStatus::No || s == at::MemOverlapStatus::TooHard, "adam_step: ", an, " and ", bn,
              " share memory; each must be its own buffer");
}

GradType grad_type_of(const at::Tensor& grad) {
  switch (grad.scalar_type()) {
    case at::kFloat:
      return GradType::kFloat32;
    case at::kBFloat16:
      return GradType::kBFloat16;
    case at::kHalf:
      return GradType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, "adam_step: grad has dtype ", grad.scalar_type(),
                       "; supported gradient dtypes are float32, bfloat16 and float16 (cast it with .float())");
  }
}

OutType out_type_of(const at::Tensor& out) {
  switch (out.scalar_type()) {
    case at::kFloat:
      return OutType::kFloat32;
    case at::kBFloat16:
      return OutType::kBFloat16;
    case at::kHalf:
      return OutType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, "adam_step: param_out has dtype ", out.scalar_type(),
                       "; supported param_out dtypes are bfloat16, float16 and float32");
  }
}

void check_hyper(const AdamHyper& h) {
  TORCH_CHECK_VALUE(h.step >= 1, "adam_step: step=", h.step, " is invalid; step counts from 1 (increment first)");
  TORCH_CHECK_VALUE(h.lr >= 0.0, "adam_step: invalid learning rate lr=", h.lr, "; need lr >= 0");
  TORCH_CHECK_VALUE(h.beta1 >= 0.0 && h.beta1 < 1.0, "adam_step: invalid beta1=", h.beta1, "; need 0 <= beta1 < 1");
  TORCH_CHECK_VALUE(h.beta2 >= 0.0 && h.beta2 < 1.0, "adam_step: invalid beta2=", h.beta2, "; need 0 <= beta2 < 1");
  TORCH_CHECK_VALUE(h.eps >= 0.0, "adam_step: invalid eps=", h.eps, "; need eps >= 0");
  TORCH_CHECK_VALUE(h.weight_decay >= 0.0, "adam_step: invalid weight_decay=", h.weight_decay,
                    "; need weight_decay >= 0");
  TORCH_CHECK_VALUE(std::isfinite(h.grad_unscale) && h.grad_unscale >= 0.0,
                    "adam_step: invalid grad_unscale=", h.grad_unscale, "; need a finite value >= 0 (1 / loss scale)");
  TORCH_CHECK_VALUE(std::isfinite(h.grad_clip) && h.grad_clip >= 0.0, "adam_step: invalid grad_clip=", h.grad_clip,
                    "; need a finite value >= 0 (the clip coefficient, <= 1)");
}

// Host-side factors, computed in double and rounded to float where torch rounds its Python-float scalars
// (torch/optim/adam.py, _single_tensor_adam; ATen casts a double scalar to the float op-math type).
Factors make_factors(const AdamHyper& h) {
  Factors f;
  if (h.weight_decay != 0.0) {
    if (h.adamw_mode) {
      f.decoupled_decay = true;
      f.decay_mul = static_cast<float>(1.0 - h.lr * h.weight_decay);  // param.mul_(1 - lr * wd)
    } else {
      f.l2_decay = true;
      f.weight_decay = static_cast<float>(h.weight_decay);  // grad.add(param, alpha=wd)
    }
  }
  // exp_avg.lerp_(grad, 1 - beta1): ATen uses self + w*(end - self) for |w| < 0.5, else end - (1 - w)*(end - self),
  // each as one fma in its vector kernel.
  const float w = static_cast<float>(1.0 - h.beta1);
  f.lerp_small = std::abs(w) < 0.5f;
  f.lerp_coeff = f.lerp_small ? w : w - 1.0f;
  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
  f.beta2 = static_cast<float>(h.beta2);
  f.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  double step_size = h.lr;
  double bc2_sqrt = 1.0;
  if (h.bias_correction) {
    const double t = static_cast<double>(h.step);
    step_size = h.lr / (1.0 - std::pow(h.beta1, t));       // Python's beta1**step is C pow
    bc2_sqrt = std::pow(1.0 - std::pow(h.beta2, t), 0.5);  // torch writes bias_correction2**0.5, not sqrt
  }
  f.inv_bc2_sqrt = static_cast<float>(1.0 / bc2_sqrt);
  f.eps = static_cast<float>(h.eps);
  f.neg_step_size = static_cast<float>(-step_size);  // param.addcdiv_(exp_avg, denom, value=-step_size)
  f.grad_unscale = static_cast<float>(h.grad_unscale);
  f.grad_clip = static_cast<float>(h.grad_clip);
  return f;
}

KernelFn kernel_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx2:
      return adam_kernel::avx2::run;
    case CpuIsa::kAvx512:
      return adam_kernel::avx512::run;
    case CpuIsa::kScalar:
      break;
  }
  return adam_kernel::scalar::run;
}

adam_kernel::TrafficFn traffic_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx2:
      return adam_kernel::avx2::traffic;
    case CpuIsa::kAvx512:
      return adam_kernel::avx512::traffic;
    case CpuIsa::kScalar:
      break;
  }
  return adam_kernel::scalar::traffic;
}

void set_state(Args& a, StateType type, const at::Tensor* m_absmax, const at::Tensor* v_absmax) {
  a.state_type = type;
  if (type != StateType::kInt8) return;
  a.exp_avg_absmax = m_absmax->data_ptr<float>();
  a.exp_avg_sq_absmax = v_absmax->data_ptr<float>();
  a.exp_avg_map = quant_map(true);
  a.exp_avg_sq_map = quant_map(false);
}

int64_t prefetch_elems() {
  static const int64_t elems = [] {
    // Measured (bench_cpu_adam.py; paired sweeps against torch's fused AdamW in one process): 1 KiB ahead gained
    // about 10% at the memory limit on Sapphire Rapids; on AMD EPYC 256 B was best at 10M and 30M elements
    // (1.13-1.21x torch, against 0.91-1.03x with 1 KiB and 1.03-1.11x with none) and best or level at 100M.
    const int64_t default_bytes = cpu_vendor() == "AuthenticAMD" ? 256 : 1024;
    const char* env = std::getenv("ZEROSHARD_ADAM_PREFETCH_BYTES");
    if (env == nullptr || *env == '\0') return default_bytes / 4;
    char* end = nullptr;
    const long long bytes = std::strtoll(env, &end, 10);
    TORCH_CHECK_VALUE(*end == '\0' && bytes >= 0 && bytes <= (1 << 20), "ZEROSHARD_ADAM_PREFETCH_BYTES=", env,
                      " is invalid; set bytes ahead in [0, 1048576] (0: no software prefetch), or unset it");
    return static_cast<int64_t>(bytes / 4);
  }();
  return elems;
}

// The threading of every step: fixed kAdamChunk-element chunks over at::parallel_for, so per-chunk partial sums (and
// their order) do not depend on the thread count.

// In-place writes through raw pointers bypass autograd's version counter; bump it like an in-place op would, so a
// graph that saved the old value errors instead of silently using the new one.
void bump_version(const at::Tensor& t) {
  if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

}  // namespace adam_detail

using namespace adam_detail;

std::optional<GradStats> adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                                   const at::Tensor& exp_avg_sq, const AdamHyper& hyper,
                                   const std::optional<at::Tensor>& param_out, bool compute_grad_stats,
                                   std::optional<std::string_view> isa, const std::optional<AdamStateScales>& scales) {
  // --- Validate everything first: nothing is written unless every check passes.
  const c10::Device device = step_device(param);
  check_tensor(param, "param", device);
  check_tensor(grad, "grad", device);
  check_tensor(exp_avg, "exp_avg", device);
  check_tensor(exp_avg_sq, "exp_avg_sq", device);
  TORCH_CHECK_TYPE(param.scalar_type() == at::kFloat || param.scalar_type() == at::kBFloat16,
                   "adam_step: param has dtype ", param.scalar_type(),
                   "; supported: float32 master weights (write a compute-dtype copy through ",
                   "param_out), or bfloat16 weights updated in place (no master)");
  const bool bf16_param = param.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(!(bf16_param && param_out.has_value()), "adam_step: param is bfloat16 and param_out is given; ",
                    "a bfloat16 param is its own compute-dtype copy: drop param_out, or step a float32 master");
  const int64_t n = param.numel();
  const at::Tensor* m_absmax = scales ? &scales->exp_avg_absmax : nullptr;
  const at::Tensor* v_absmax = scales ? &scales->exp_avg_sq_absmax : nullptr;
  const StateType state_type = state_type_of(exp_avg, exp_avg_sq, m_absmax, v_absmax, n,
                                             [](const char* key) { return std::string("adam_step: ") + key; });
  const bool int8_state = state_type == StateType::kInt8;
  if (int8_state) {
    check_tensor(*m_absmax, "exp_avg_absmax", device);
    check_tensor(*v_absmax, "exp_avg_sq_absmax", device);
    const at::Tensor* others[] = {&param, &grad, &exp_avg, &exp_avg_sq};
    const char* names[] = {"param", "grad", "exp_avg", "exp_avg_sq"};
    for (int k = 0; k < 4; ++k) {
      check_no_overlap(*m_absmax, "exp_avg_absmax", *others[k], names[k]);
      check_no_overlap(*v_absmax, "exp_avg_sq_absmax", *others[k], names[k]);
    }
    check_no_overlap(*m_absmax, "exp_avg_absmax", *v_absmax, "exp_avg_sq_absmax");
    if (param_out.has_value()) {
      check_no_overlap(*param_out, "param_out", *m_absmax, "exp_avg_absmax");
      check_no_overlap(*param_out, "param_out", *v_absmax, "exp_avg_sq_absmax");
    }
  }
  const GradType grad_type = grad_type_of(grad);
  check_numel(grad, "grad", n);
  check_numel(exp_avg, "exp_avg", n);
  check_numel(exp_avg_sq, "exp_avg_sq", n);
  check_no_overlap(param, "param", exp_avg, "exp_avg");
  check_no_overlap(param, "param", exp_avg_sq, "exp_avg_sq");
  check_no_overlap(exp_avg, "exp_avg", exp_avg_sq, "exp_avg_sq");
  check_no_overlap(grad, "grad", param, "param");
  check_no_overlap(grad, "grad", exp_avg, "exp_avg");
  check_no_overlap(grad, "grad", exp_avg_sq, "exp_avg_sq");
  OutType out_type = OutType::kNone;
  if (param_out.has_value()) {
    const at::Tensor& out = *param_out;
    check_tensor(out, "param_out", device);
    out_type = out_type_of(out);
    check_numel(out, "param_out", n);
    check_no_overlap(out, "param_out", param, "param");
    check_no_overlap(out, "param_out", grad, "grad");
    check_no_overlap(out, "param_out", exp_avg, "exp_avg");
    check_no_overlap(out, "param_out", exp_avg_sq, "exp_avg_sq");
  }
  check_hyper(hyper);
  if (device.is_cuda()) {
    TORCH_CHECK_VALUE(!isa.has_value(), "adam_step: isa='", isa.value_or(""),
                      "' picks a CPU kernel build; drop it for CUDA tensors");
    TORCH_CHECK_VALUE(!compute_grad_stats, "adam_step: grad_stats=True comes from the CPU kernel only; for CUDA ",
                      "tensors take the norm with torch (torch.linalg.vector_norm)");
    TORCH_CHECK_VALUE(!param_out.has_value(), "adam_step: param_out is written by the CPU kernel only; for CUDA ",
                      "tensors copy the updated param (param_out.copy_(param))");
  }
  const KernelFn kernel = device.is_cuda() ? nullptr : kernel_for(resolve_cpu_isa(isa));

  // --- Run: fixed chunks, so the partial sums and their order do not depend on the thread count.
  Args args;
  args.param = param.data_ptr();
  args.param_type = bf16_param ? adam_kernel::ParamType::kBFloat16 : adam_kernel::ParamType::kFloat32;
  args.exp_avg = exp_avg.data_ptr();
  args.exp_avg_sq = exp_avg_sq.data_ptr();
  set_state(args, state_type, m_absmax, v_absmax);
  args.grad = grad.data_ptr();
  args.grad_type = grad_type;
  args.param_out = param_out.has_value() ? param_out->data_ptr() : nullptr;
  args.out_type = out_type;
  args.prefetch_elems = prefetch_elems();
  args.f = make_factors(hyper);

  const int64_t chunks = (n + kAdamChunk - 1) / kAdamChunk;
  std::vector<double> partial(compute_grad_stats ? chunks : 0, 0.0);
  if (device.is_cuda()) {
    run_cuda_step(args, n, device);  // asynchronous, on the device's current stream
  } else {
    for_each_chunk(n, [&](int64_t c, int64_t begin, int64_t end) {
      const double s = kernel(args, begin, end, compute_grad_stats);
      if (compute_grad_stats) partial[c] = s;
    });
  }
  bump_version(param);
  bump_version(exp_avg);
  bump_version(exp_avg_sq);
  if (int8_state) {
    bump_version(*m_absmax);
    bump_version(*v_absmax);
  }
  if (param_out.has_value()) bump_version(*param_out);

  if (!compute_grad_stats) return std::nullopt;
  GradStats stats;
  for (double s : partial) stats.grad_sq_sum += s;
  // Squares are formed in double, where no finite float overflows, so a non-finite sum means a non-finite gradient.
  stats.found_inf = !std::isfinite(stats.grad_sq_sum);
  return stats;
}

int64_t adam_prefetch_bytes() { return prefetch_elems() * 4; }

void adam_traffic_reference(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                            const at::Tensor& exp_avg_sq, std::optional<std::string_view> isa) {
  const int64_t n = param.numel();
  const char* names[] = {"param", "grad", "exp_avg", "exp_avg_sq"};
  const at::Tensor* ts[] = {&param, &grad, &exp_avg, &exp_avg_sq};
  for (int i = 0; i < 4; ++i) {
    check_tensor(*ts[i], names[i]);
    TORCH_CHECK_TYPE(ts[i]->scalar_type() == at::kFloat, "adam_traffic_reference: ", names[i], " has dtype ",
                     ts[i]->scalar_type(), "; the reference moves fp32 data only");
    check_numel(*ts[i], names[i], n);
  }
  const adam_kernel::TrafficFn traffic = traffic_for(resolve_cpu_isa(isa));
  Args args;
  args.param = param.data_ptr<float>();
  args.exp_avg = exp_avg.data_ptr<float>();
  args.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  args.grad = grad.data_ptr();
  args.prefetch_elems = prefetch_elems();
  for_each_chunk(n, [&](int64_t, int64_t begin, int64_t end) { traffic(args, begin, end); });
}

}  // namespace zeroshard
