#include "python/bindings.h"

namespace zeroshard::python {

void bind_adam(pybind11::module_& m) {}

}  // namespace zeroshard::python
