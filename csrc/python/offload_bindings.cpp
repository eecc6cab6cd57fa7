// zeroshard._C host buffers, copy queues and the offloaded Adam pipeline (csrc/offload/) for the Python layer.
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "offload/copy_queue.h"
#include "offload/host_memory.h"
#include "offload/offload_pipeline.h"
#include "python/bindings.h"

namespace zeroshard::python {

namespace py = pybind11;

namespace {

// (master, exp_avg, exp_avg_sq, grad, grad_ticket, param_out, device_param, step, lr, beta1, beta2, eps,
//  weight_decay, adamw_mode, bias_correction, grad_unscale, grad_clip[, exp_avg_absmax, exp_avg_sq_absmax])
using SegmentTuple =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, std::optional<at::Tensor>,
               std::optional<at::Tensor>, int64_t, double, double, double, double, double, bool, bool, double, double>;
constexpr size_t kSegmentFields = std::tuple_size_v<SegmentTuple>;

// The 17 fields, plus the two absmax tensors of int8 state (uint8 moments) when the tuple has 19.
OffloadSegment to_segment(const py::tuple& item) {
  TORCH_CHECK_VALUE(item.size() == kSegmentFields || item.size() == kSegmentFields + 2,
                    "HostAdamPipeline.step: a segment has ", item.size(), " fields; pass ", kSegmentFields,
                    " (see the docstring), plus exp_avg_absmax and exp_avg_sq_absmax for int8 state");
  py::tuple head(kSegmentFields);
  for (size_t i = 0; i < kSegmentFields; ++i) head[i] = item[i];
  const auto t = head.cast<SegmentTuple>();
  OffloadSegment s;
  s.master = std::get<0>(t);
  s.exp_avg = std::get<1>(t);
  s.exp_avg_sq = std::get<2>(t);
  s.grad = std::get<3>(t);
  s.grad_ticket = std::get<4>(t);
  if (std::get<5>(t)) s.param_out = *std::get<5>(t);
  if (std::get<6>(t)) s.device_param = *std::get<6>(t);
  s.hyper = AdamHyper{std::get<7>(t),  std::get<8>(t),  std::get<9>(t),  std::get<10>(t), std::get<11>(t),
                      std::get<12>(t), std::get<13>(t), std::get<14>(t), std::get<15>(t), std::get<16>(t)};
  if (item.size() == kSegmentFields + 2) {
    s.exp_avg_absmax = item[kSegmentFields].cast<at::Tensor>();
    s.exp_avg_sq_absmax = item[kSegmentFields + 1].cast<at::Tensor>();
  }
  return s;
}

}  // namespace

void bind_offload(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;

  m.def("empty_host", &empty_host, py::arg("numel"), py::arg("dtype"), py::arg("pin"), R"doc(
Uninitialised 1-D CPU tensor of exactly ``numel`` elements. With ``pin`` and a CUDA device: page-locked memory from
cudaHostAlloc of exactly that size (torch's pinned allocator rounds up to a power of two); otherwise 64-byte-aligned
pageable memory. Raises RuntimeError naming the byte count if the allocation fails.)doc");
  m.def(
      "host_memory_stats",
      []() {
        const HostMemoryStats s = host_memory_stats();
        py::dict d;
        d["pinned_bytes"] = s.pinned_bytes;
        d["unpinned_bytes"] = s.unpinned_bytes;
        d["peak_pinned_bytes"] = s.peak_pinned_bytes;
        d["peak_unpinned_bytes"] = s.peak_unpinned_bytes;
        return d;
      },
      "Bytes held by live empty_host tensors and their peaks: dict with pinned_bytes, unpinned_bytes, "
      "peak_pinned_bytes, peak_unpinned_bytes.");
  m.def("host_available_bytes", &host_available_bytes, "MemAvailable from /proc/meminfo, in bytes.");
  m.def("check_host_budget", &check_host_budget, py::arg("nbytes"), py::arg("what"),
        "Raises ValueError naming `what` when nbytes exceeds host_available_bytes().");

  py::class_<CopyQueue, std::shared_ptr<CopyQueue>>(m, "CopyQueue", R"doc(
Asynchronous copies in enqueue order, identified by tickets increasing from 1. Create with make_copy_queue(device).)doc")
      .def_property_readonly("device", &CopyQueue::device)
      .def("wait_current_stream", &CopyQueue::wait_current_stream,
           "Later copies start after the work already issued on the current CUDA stream (CPU queue: no-op).")
      .def("copy", &CopyQueue::copy, py::arg("dst"), py::arg("src"), Release(), R"doc(
Enqueues dst <- src (contiguous, same dtype and numel); returns the ticket. Both tensors stay alive until the copy
ends; do not touch them before synchronize / current_stream_wait of the ticket.)doc")
      .def("synchronize", &CopyQueue::synchronize, py::arg("ticket"), Release(),
           "Blocks until copy `ticket` and all earlier ones finished (ticket <= 0: at once); re-raises a copy error.")
      .def("current_stream_wait", &CopyQueue::current_stream_wait, py::arg("ticket"), Release(),
           "The current CUDA stream waits for copy `ticket` without blocking the host (CPU queue: synchronize).")
      .def("last_ticket", &CopyQueue::last_ticket)
      .def("stats", &CopyQueue::stats, "(bytes, seconds) of finished copies since the last reset_stats().")
      .def("reset_stats", &CopyQueue::reset_stats);
  m.def("make_copy_queue", &make_copy_queue, py::arg("device"),
        "A CopyQueue for torch.device('cpu') (worker thread) or a CUDA device (its own stream).");

  py::class_<HostAdamPipeline>(m, "HostAdamPipeline", R"doc(
Chunked Adam step over offloaded (host) optimizer state: waits for each segment's gradient copy on d2h, steps it in
chunks of chunk_elems elements, and uploads the new weights through two staging buffers on h2d.)doc")
      .def(py::init<std::shared_ptr<CopyQueue>, std::shared_ptr<CopyQueue>, int64_t, bool>(), py::arg("d2h"),
           py::arg("h2d"), py::arg("chunk_elems"), py::arg("pin"))
      .def(
          "step",
          [](HostAdamPipeline& self, const std::vector<py::tuple>& segments,
             bool compute_grad_stats) -> std::optional<std::tuple<double, bool>> {
            std::vector<OffloadSegment> segs;
            segs.reserve(segments.size());
            for (const auto& t : segments) segs.push_back(to_segment(t));
            std::optional<GradStats> stats;
            {
              py::gil_scoped_release no_gil;
              stats = self.step(segs, compute_grad_stats);
            }
            if (!stats) return std::nullopt;
            return std::make_tuple(stats->grad_sq_sum, stats->found_inf);
          },
          py::arg("segments"), py::arg("compute_grad_stats") = false, R"doc(
segments: list of (master, exp_avg, exp_avg_sq, grad, grad_ticket, param_out or None, device_param or None, step, lr,
beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_unscale, grad_clip): the last two multiply the
gradient in the kernel (1.0: no scaling; see adam_step). Returns None, or (grad_sq_sum, found_inf) when
compute_grad_stats. int8 state (uint8 moments): two more fields, exp_avg_absmax and exp_avg_sq_absmax (fp32, CPU,
ceil(numel / 2048) each, updated in place); such a segment steps in chunks of int8_chunk_elems (whole blocks).
Everything is validated before anything is written.)doc")
      .def("upload_buffer_bytes", &HostAdamPipeline::upload_buffer_bytes)
      .def_property_readonly("chunk_elems", &HostAdamPipeline::chunk_elems)
      .def_property_readonly("int8_chunk_elems", &HostAdamPipeline::int8_chunk_elems);
}

}  // namespace zeroshard::python
