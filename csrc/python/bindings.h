// pybind11 registration functions, one per concept. Only files under csrc/python/ see Python.
#pragma once

#include <torch/extension.h>

namespace zeroshard::python {

void bind_adam(pybind11::module_& m);     // adam_bindings.cpp
void bind_flat(pybind11::module_& m);     // flat_bindings.cpp
void bind_comm(pybind11::module_& m);     // comm_bindings.cpp
void bind_offload(pybind11::module_& m);  // offload_bindings.cpp

}  // namespace zeroshard::python
