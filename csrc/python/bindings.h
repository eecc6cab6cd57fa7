// pybind11 registration functions, one per concept. Only files under csrc/python/ see Python.
#pragma once

// torch/python.h (pybind11 and the Tensor/ProcessGroup casters) rather than torch/extension.h, which adds the whole
// C++ frontend (torch/all.h: nn, optim, data) that no binding uses and costs 16 s of compile per file.
#include <torch/python.h>

namespace zeroshard::python {

void bind_adam(pybind11::module_& m);     // adam_bindings.cpp
void bind_flat(pybind11::module_& m);     // flat_bindings.cpp
void bind_comm(pybind11::module_& m);     // comm_bindings.cpp
void bind_grad(pybind11::module_& m);     // grad_bindings.cpp
void bind_offload(pybind11::module_& m);  // offload_bindings.cpp

}  // namespace zeroshard::python
