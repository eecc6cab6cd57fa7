// Python bindings of the fused CPU Adam (zeroshard._C.adam_step) and of the ISA query functions.
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "adam/adam.h"
#include "adam/adam_cuda.h"
#include "adam/adam_group.h"
#include "adam/cpu_isa.h"
#include "python/bindings.h"

namespace zeroshard::python {

namespace py = pybind11;

void bind_adam(py::module_& m) {
  m.def(
      "adam_step",
      [](const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
         int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
         bool bias_correction, const std::optional<at::Tensor>& param_out, bool compute_grad_stats,
         const std::optional<std::string>& isa, double grad_unscale, double grad_clip,
         const std::optional<at::Tensor>& exp_avg_absmax,
         const std::optional<at::Tensor>& exp_avg_sq_absmax) -> std::optional<std::tuple<double, bool>> {
        AdamHyper h{step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_unscale, grad_clip};
        std::optional<AdamStateScales> scales;
        if (exp_avg_absmax || exp_avg_sq_absmax) {
          scales = AdamStateScales{exp_avg_absmax.value_or(at::Tensor()), exp_avg_sq_absmax.value_or(at::Tensor())};
        }
        std::optional<GradStats> stats;
        {
          // The step touches only tensor memory, never Python objects: let other Python threads run.
          py::gil_scoped_release no_gil;
          stats = adam_step(param, grad, exp_avg, exp_avg_sq, h, param_out, compute_grad_stats,
                            isa ? std::optional<std::string_view>(*isa) : std::nullopt, scales);
        }
        if (!stats) return std::nullopt;
        return std::make_tuple(stats->grad_sq_sum, stats->found_inf);
      },
      py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("step"), py::arg("lr"),
      py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw_mode"),
      py::arg("bias_correction"), py::arg("param_out") = py::none(), py::arg("compute_grad_stats") = false,
      py::arg("isa") = py::none(), py::arg("grad_unscale") = 1.0, py::arg("grad_clip") = 1.0,
      py::arg("exp_avg_absmax") = py::none(), py::arg("exp_avg_sq_absmax") = py::none(),
      "Fused Adam/AdamW step in place on CPU (or CUDA) tensors; see zeroshard.ops.adam_step. Returns None, or "
      "(grad_sq_sum: float, found_inf: bool) when compute_grad_stats.");
  m.def("adam_cuda_available", &adam_detail::cuda_step_available,
        "Whether adam_step steps CUDA tensors in this build (its CUDA parts were compiled: a CUDA torch and nvcc).");
  py::class_<AdamGroup>(m, "AdamGroup", R"doc(
The tensors of one param group of the fused CPU Adam, checked once: AdamGroup(params, exp_avgs, exp_avg_sqs, label,
group_index, exp_avg_absmaxes=None, exp_avg_sq_absmaxes=None). Each list has one CPU, dense, contiguous tensor per
parameter; the moments of each in one state format (float32, bfloat16, or uint8 codes with fp32 absmax lists, None
where a tensor's state is not int8; see zeroshard.ops.adam_step). Raises ValueError (TypeError for a state dtype)
naming "<label> param <i> of group <group_index> (shape ...)" and the fix. Step with adam_step_groups.)doc")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<at::Tensor> exp_avgs,
                       std::vector<at::Tensor> exp_avg_sqs, std::string label, int64_t group_index,
                       const std::optional<std::vector<std::optional<at::Tensor>>>& m_absmax,
                       const std::optional<std::vector<std::optional<at::Tensor>>>& v_absmax) {
             const auto unwrap = [](const std::optional<std::vector<std::optional<at::Tensor>>>& l) {
               std::vector<at::Tensor> out;
               if (l) {
                 for (const auto& t : *l) out.push_back(t ? *t : at::Tensor());
               }
               return out;
             };
             return AdamGroup(std::move(params), std::move(exp_avgs), std::move(exp_avg_sqs), std::move(label),
                              group_index, unwrap(m_absmax), unwrap(v_absmax));
           }),
           py::arg("params"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("label"), py::arg("group_index"),
           py::arg("exp_avg_absmaxes") = py::none(), py::arg("exp_avg_sq_absmaxes") = py::none())
      .def("__len__", &AdamGroup::size);
  m.def(
      "adam_step_groups",
      [](const std::vector<std::tuple<const AdamGroup*, std::vector<std::optional<at::Tensor>>, std::vector<int64_t>,
                                      double, double, double, double, double, bool, bool, double, double>>& work,
         bool compute_grad_stats, const std::optional<std::string>& isa) -> std::optional<std::tuple<double, bool>> {
        std::vector<AdamGroupStep> steps;
        steps.reserve(work.size());
        for (const auto& [group, grads, counts, lr, b1, b2, eps, wd, adamw, bc, unscale, clip] : work) {
          AdamGroupStep w;
          w.group = group;
          w.grads.reserve(grads.size());
          for (const auto& g : grads) w.grads.push_back(g ? *g : at::Tensor());
          w.steps = counts;
          w.hyper = AdamHyper{1, lr, b1, b2, eps, wd, adamw, bc, unscale, clip};
          steps.push_back(std::move(w));
        }
        std::optional<GradStats> stats;
        {
          py::gil_scoped_release no_gil;
          stats =
              adam_step_groups(steps, compute_grad_stats, isa ? std::optional<std::string_view>(*isa) : std::nullopt);
        }
        if (!stats) return std::nullopt;
        return std::make_tuple(stats->grad_sq_sum, stats->found_inf);
      },
      py::arg("work"), py::arg("compute_grad_stats") = false, py::arg("isa") = py::none(), R"doc(
One Adam step over several AdamGroups. work: list of (group, grads, steps, lr, beta1, beta2, eps, weight_decay,
adamw_mode, bias_correction, grad_unscale, grad_clip) with grads a list (one per tensor; None skips it) and steps the
counts before this step (each stepped tensor uses count + 1). Everything is checked before anything is written.
Returns None, or (grad_sq_sum, found_inf) when compute_grad_stats.)doc");
  m.def(
      "adam_traffic_reference",
      [](const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
         const std::optional<std::string>& isa) {
        py::gil_scoped_release no_gil;
        adam_traffic_reference(param, grad, exp_avg, exp_avg_sq,
                               isa ? std::optional<std::string_view>(*isa) : std::nullopt);
      },
      py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("isa") = py::none(),
      "adam_step's fp32 memory traffic with no arithmetic (values unchanged); see "
      "zeroshard.ops.adam_traffic_reference.");
  m.attr("ADAM_QUANT_BLOCK") = kAdamQuantBlock;
  m.def("adam_dynamic_map", &adam_dynamic_map, py::arg("signed"),
        "The 256-value dynamic 8-bit map of int8 Adam state (signed: exp_avg, unsigned: exp_avg_sq), ascending fp32; "
        "see zeroshard.ops.dynamic_map.");
  m.def("adam_dynamic_map_thresholds", &adam_dynamic_map_thresholds, py::arg("signed"),
        "Exact nearest-code thresholds of that map (element k: smallest float >= midpoint of values k-1 and k).");
  m.def(
      "cpu_isa", []() { return zeroshard::cpu_isa(); },
      "Name of the ISA the fused CPU Adam uses now: 'scalar', 'avx2' or 'avx512' (honours ZEROSHARD_CPU_ISA).");
  m.def("cpu_vendor", []() { return zeroshard::cpu_vendor(); }, "CPUID vendor string, e.g. 'GenuineIntel'.");
  m.def("adam_prefetch_bytes", &zeroshard::adam_prefetch_bytes,
        "Bytes ahead the fused CPU Adam prefetches on each stream (ZEROSHARD_ADAM_PREFETCH_BYTES, else per vendor).");
  m.def(
      "supported_cpu_isas",
      []() {
        std::vector<std::string> names;
        for (CpuIsa isa : zeroshard::supported_cpu_isas()) names.emplace_back(cpu_isa_name(isa));
        return names;
      },
      "ISAs this CPU and OS can run, ascending, e.g. ['scalar', 'avx2'].");
}

}  // namespace zeroshard::python
