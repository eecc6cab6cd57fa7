#include "python/bindings.h"

namespace zeroshard::python {

void bind_comm(pybind11::module_& m) {}

}  // namespace zeroshard::python
