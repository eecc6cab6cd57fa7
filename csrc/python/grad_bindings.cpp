// zeroshard._C.GradBuffer / GradHooks (csrc/grad/) for the Python layer.
#include "grad/grad_buffer.h"
#include "grad/grad_hooks.h"
#include "python/bindings.h"

#include <torch/csrc/Exceptions.h>

namespace zeroshard::python {

namespace py = pybind11;

namespace {

// A Python callable as a GradHooks callback: called with the GIL (hooks run without it, on autograd's thread); an
// exception it raises ends the backward as the same Python exception (torch's own C++-to-Python hooks throw
// python_error the same way), so a CollectiveError raised while launching a reduction reaches the caller unchanged.
template <typename... Args>
std::function<void(Args...)> callback(py::function fn) {
  auto held = std::make_shared<py::function>(std::move(fn));
  return [held](Args... args) {
    py::gil_scoped_acquire gil;
    try {
      (*held)(args...);
    } catch (py::error_already_set& e) {
      e.restore();
      throw python_error();
    }
  };
}

}  // namespace

void bind_grad(py::module_& m) {
  py::class_<GradBuffer, std::shared_ptr<GradBuffer>>(m, "GradBuffer", R"doc(
The full-size gradient accumulation buffer of one flat parameter: ``layout.padded_numel`` elements of ``dtype`` on
``device``, the input of its reduction. Allocated uninitialised on first use and never zero-filled as a whole: the
padding is zeroed at allocation, a parameter's first gradient is copied into its view and later ones added (as DDP's
reducer fills its buckets), and views no gradient reached read as zeros once ``views()`` is called.)doc")
      .def(py::init<FlatParamLayout, at::ScalarType, at::Device>(), py::arg("layout"), py::arg("dtype"),
           py::arg("device"))
      .def_property_readonly("allocated", &GradBuffer::allocated, "bool: whether the buffer holds memory")
      .def_property_readonly("full", &GradBuffer::full, "Tensor (1-D, padded_numel elements) or None if not allocated")
      .def("accumulate", &GradBuffer::accumulate, py::arg("index"), py::arg("grad"), R"doc(
Adds ``grad`` (parameter ``index``'s shape; any floating dtype, converted as ``copy_`` does) into its view, allocating
the buffer on first use: the first gradient since allocation or ``reset()`` is copied, later ones added. Call it with
grad mode off. Raises RuntimeError naming a bad index or shape.)doc")
      .def("views", &GradBuffer::views, R"doc(
Per-parameter views of the buffer (allocating it on first use); every element reads as accumulated: zeros where no
gradient arrived since allocation or ``reset()``.)doc")
      .def("reset", &GradBuffer::reset, "Stage 1: the kept buffer reads as zeros again, without writing it.")
      .def("release", &GradBuffer::release, "Gives the memory back; the next gradient allocates a fresh buffer.")
      .def("unwritten", &GradBuffer::unwritten, "list[int]: parameters not written since allocation or reset()")
      .def("padding", &GradBuffer::padding, "list[(begin, end)]: element ranges of the padding, zeroed at allocation");

  py::class_<GradHooks>(m, "GradHooks", R"doc(
A post hook on the gradient accumulator of every parameter of a list of flat parameters (DDP's C++ reducer hooks its
buckets the same way): each moves its parameter's fresh ``.grad`` into the flat parameter's ``GradBuffer`` (``.grad``
becomes None) and counts it. Python hears only ``on_first()`` once per backward (before the first gradient is
accumulated) and ``on_complete(f)`` once flat parameter ``f`` has reported every parameter. The hooks run in C++ on
autograd's thread: ~22 us of Python per parameter fewer than a ``register_post_accumulate_grad_hook`` (issue 22).
Compiled autograd cannot trace them (as DDP's C++ reducer hooks).)doc")
      .def(py::init([](std::vector<std::vector<at::Tensor>> params, std::vector<std::shared_ptr<GradBuffer>> buffers,
                       py::function on_first, py::function on_complete) {
             return std::make_unique<GradHooks>(std::move(params), std::move(buffers), callback<>(std::move(on_first)),
                                                callback<int64_t>(std::move(on_complete)));
           }),
           py::arg("params"), py::arg("buffers"), py::arg("on_first"), py::arg("on_complete"), R"doc(
Args:
    params: per flat parameter, its parameters in layout order (leaf tensors that require grad).
    buffers: per flat parameter, its ``GradBuffer``.
    on_first: ``callable()``: the first gradient of a backward arrived (until ``active`` is set False again).
    on_complete: ``callable(f)``: flat parameter ``f`` has a gradient for every parameter since ``reset_reported()``.

Raises:
    RuntimeError: the counts differ, or a parameter is not a leaf that requires grad.)doc")
      .def("on_grad", &GradHooks::on_grad, py::arg("f"), py::arg("i"), py::call_guard<py::gil_scoped_release>(),
           "The hook's body for parameter i of flat parameter f (what autograd runs after accumulating .grad).")
      .def("remove", &GradHooks::remove, "Removes every hook; idempotent.")
      .def_property("active", &GradHooks::active, &GradHooks::set_active,
                    "bool: a backward started (a first gradient arrived) and was not ended by setting this False")
      .def("complete", &GradHooks::complete, py::arg("f"),
           "Whether flat parameter f has reported every parameter since reset_reported().")
      .def("reset_reported", &GradHooks::reset_reported, "Forgets which parameters reported (after a reduction).")
      .def("take_used", &GradHooks::take_used, py::arg("f"),
           "list[int]: parameters of flat parameter f that got a gradient since the last call (then cleared).")
      .def_property_readonly("num_flat_params", &GradHooks::num_flat_params);
}

}  // namespace zeroshard::python
