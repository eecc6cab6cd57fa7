// zeroshard._C.FlatParamLayout: the flat-parameter layout (csrc/flat/flat_layout.h) for the Python layer.
#include "flat/flat_layout.h"
#include "python/bindings.h"

#include <sstream>
#include <tuple>

namespace zeroshard::python {

namespace py = pybind11;

void bind_flat(py::module_& m) {
  py::class_<FlatParamLayout>(m, "FlatParamLayout", R"doc(
Where each parameter of a unit lives inside one padded 1-D flat buffer, and which part each rank owns.

Parameters start at multiples of ``align_elems``; the buffer is padded to a multiple of ``world_size * align_elems``
elements and cut into ``world_size`` equal shards (rank r owns ``[r * shard_numel, (r + 1) * shard_numel)``). A
parameter may straddle shards. All sizes and offsets are in elements.)doc")
      .def(py::init<std::vector<std::vector<int64_t>>, int64_t, int64_t>(), py::arg("shapes"), py::arg("world_size"),
           py::arg("align_elems"), R"doc(
Args:
    shapes: one shape (list of ints) per parameter; ``[]`` is a scalar, a 0 dim an empty parameter.
    world_size: number of shards (>= 1).
    align_elems: alignment of each parameter offset, in elements (>= 1; pass at least 64 bytes / element size).

Raises:
    RuntimeError: world_size < 1, align_elems < 1, a negative dim, or a size overflowing int64.)doc")
      .def_property_readonly("world_size", &FlatParamLayout::world_size)
      .def_property_readonly("align_elems", &FlatParamLayout::align_elems)
      .def_property_readonly("num_params", &FlatParamLayout::num_params)
      .def_property_readonly("shapes", &FlatParamLayout::shapes, "list[list[int]]: the parameter shapes")
      .def_property_readonly("numels", &FlatParamLayout::numels, "list[int]: elements per parameter")
      .def_property_readonly("offsets", &FlatParamLayout::offsets, "list[int]: start of each parameter in the buffer")
      .def_property_readonly("total_numel", &FlatParamLayout::total_numel, "int: end of the last parameter (unpadded)")
      .def_property_readonly("padded_numel", &FlatParamLayout::padded_numel, "int: size of the flat buffer")
      .def_property_readonly("shard_numel", &FlatParamLayout::shard_numel, "int: padded_numel // world_size")
      .def("shard_range", &FlatParamLayout::shard_range, py::arg("rank"),
           "(begin, end) of rank's shard in the flat buffer. Raises RuntimeError if rank is not in [0, world_size).")
      .def(
          "shard_slices",
          [](const FlatParamLayout& l, int64_t rank) {
            std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
            for (const ShardSlice& s : l.shard_slices(rank)) {
              out.emplace_back(s.param_index, s.param_offset, s.shard_offset, s.numel);
            }
            return out;
          },
          py::arg("rank"), R"doc(
Every parameter piece inside rank's shard, in parameter order, as tuples
``(param_index, param_offset, shard_offset, numel)``: elements ``[param_offset, param_offset + numel)`` of the flattened
parameter sit at ``[shard_offset, shard_offset + numel)`` of the shard. Across ranks they cover every element once.)doc")
      .def("views", &FlatParamLayout::views, py::arg("flat"), R"doc(
Per-parameter views (``flat.narrow(...).view(shape)``) into ``flat``: 1-D, contiguous, ``padded_numel`` elements.
Raises RuntimeError otherwise.)doc")
      .def("flatten", &FlatParamLayout::flatten, py::arg("tensors"), py::arg("dtype") = py::none(),
           py::arg("device") = py::none(), R"doc(
A new zero-padded flat buffer of ``padded_numel`` elements holding ``tensors`` (one per parameter, matching shapes, any
strides). dtype / device default to ``tensors[0]``'s. Raises RuntimeError on a count or shape mismatch.)doc")
      .def("copy_into", &FlatParamLayout::copy_into, py::arg("flat"), py::arg("tensors"),
           "Copies tensors into their places in flat (padding untouched). Shapes are checked; dtype/device convert.")
      .def("copy_out", &FlatParamLayout::copy_out, py::arg("flat"), py::arg("tensors"),
           "Copies each parameter's piece of flat into tensors[i]. Shapes are checked; dtype/device convert.")
      .def("__repr__", [](const FlatParamLayout& l) {
        std::ostringstream os;
        os << "FlatParamLayout(num_params=" << l.num_params() << ", world_size=" << l.world_size()
           << ", align_elems=" << l.align_elems() << ", total_numel=" << l.total_numel()
           << ", padded_numel=" << l.padded_numel() << ", shard_numel=" << l.shard_numel() << ")";
        return os.str();
      });
}

}  // namespace zeroshard::python
