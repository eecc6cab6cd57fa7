// The zeroshard._C extension module.
#include "python/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "zeroshard compiled core: fused CPU Adam, flat-parameter layouts, gradient buffers and hooks, bucketed "
      "collectives, host buffers";
  zeroshard::python::bind_adam(m);
  zeroshard::python::bind_flat(m);
  zeroshard::python::bind_comm(m);
  zeroshard::python::bind_grad(m);
  zeroshard::python::bind_offload(m);
}
