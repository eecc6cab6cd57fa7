// Python bindings of the fused CPU Adam (zeroshard._C.adam_step) and of the ISA query functions.
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "adam/adam.h"
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
         const std::optional<std::string>& isa) -> std::optional<std::tuple<double, bool>> {
        AdamHyper h{step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction};
        std::optional<GradStats> stats;
        {
          // The step touches only tensor memory, never Python objects: let other Python threads run.
          py::gil_scoped_release no_gil;
          stats = adam_step(param, grad, exp_avg, exp_avg_sq, h, param_out, compute_grad_stats,
                            isa ? std::optional<std::string_view>(*isa) : std::nullopt);
        }
        if (!stats) return std::nullopt;
        return std::make_tuple(stats->grad_sq_sum, stats->found_inf);
      },
      py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("step"), py::arg("lr"),
      py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw_mode"),
      py::arg("bias_correction"), py::arg("param_out") = py::none(), py::arg("compute_grad_stats") = false,
      py::arg("isa") = py::none(),
      "Fused Adam/AdamW step in place on CPU tensors; see zeroshard.ops.adam_step. Returns None, or "
      "(grad_sq_sum: float, found_inf: bool) when compute_grad_stats.");
  m.def(
      "cpu_isa", []() { return zeroshard::cpu_isa(); },
      "Name of the ISA the fused CPU Adam uses now: 'scalar', 'avx2' or 'avx512' (honours ZEROSHARD_CPU_ISA).");
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
