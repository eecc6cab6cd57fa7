// zeroshard._C.BucketedCollectives / CollectiveHandle (csrc/comm/) for the Python layer. The process group is the
// torch.distributed ProcessGroup object itself: torch registers it with the intrusive_ptr holder, so it crosses as-is.
#include "comm/bucketed_collectives.h"
#include "python/bindings.h"

namespace zeroshard::python {

namespace py = pybind11;

void bind_comm(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;

  py::class_<CollectiveHandle>(m, "CollectiveHandle", R"doc(
An in-flight bucketed collective. Outputs are valid only after ``wait()``; inputs and outputs must stay alive and
untouched until then.)doc")
      .def("wait", &CollectiveHandle::wait, Release(), R"doc(
Waits for every collective, then unpacks / scales / accumulates into the outputs. On CUDA this only makes the current
stream wait (no host sync). A second call is a no-op. Raises RuntimeError if a collective failed (e.g. timed out).)doc")
      .def("is_completed", &CollectiveHandle::is_completed,
           "True once every collective has finished (wait() will not block on the network) or wait() has run.")
      .def_property_readonly("num_works", &CollectiveHandle::num_works,
                             "int: collectives launched (one per non-empty bucket)");

  py::class_<BucketedCollectives>(m, "BucketedCollectives", R"doc(
Bucketed all-gather / reduce-scatter / all-reduce over a torch.distributed ProcessGroup (NCCL or gloo).

Consecutive tensors are grouped into buckets whose full-buffer size is <= ``bucket_elems`` elements (a larger tensor
gets its own bucket); each bucket is one collective. Every rank must make the same calls with the same sizes. All
inputs are validated before anything is launched. Reductions are SUM then ``* scale`` (never ReduceOp.AVG).)doc")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>>(), py::arg("process_group"),
           "process_group: a torch.distributed ProcessGroup, e.g. dist.group.WORLD or dist.new_group(...).")
      .def_property_readonly("rank", &BucketedCollectives::rank)
      .def_property_readonly("world_size", &BucketedCollectives::world_size)
      .def("all_gather", &BucketedCollectives::all_gather, py::arg("shards"), py::arg("fulls"), py::arg("bucket_elems"),
           Release(), R"doc(
After wait(): ``fulls[i].view(-1) == cat([shards[i] of rank r for r in range(world_size)])``.

Args:
    shards: list of contiguous tensors, one dtype, one device; shards[i] may be the view
        ``fulls[i].view(-1)[rank * S : (rank + 1) * S]`` (in-place all-gather).
    fulls: list of contiguous tensors (any shape) of ``world_size * shards[i].numel()`` elements, same dtype/device.
    bucket_elems: bucket size in elements of the full buffers (>= 1).

Returns: CollectiveHandle. Raises RuntimeError on mismatched lengths, sizes, dtypes, devices or non-contiguity.)doc")
      .def("reduce_scatter", &BucketedCollectives::reduce_scatter, py::arg("fulls"), py::arg("shards"),
           py::arg("bucket_elems"), py::arg("scale") = 1.0, py::arg("accumulate") = false, Release(), R"doc(
After wait(): ``shards[i] (=, or += if accumulate) scale * sum over ranks of fulls[i].view(world_size, S)[rank]``.

Args:
    fulls: list of contiguous tensors, one dtype, ``world_size * shards[i].numel()`` elements each. They may be
        overwritten (gloo reduces in place).
    shards: list of contiguous tensors, one dtype which may be wider than the fulls' (e.g. bf16 fulls, fp32 shards):
        the sum runs in the fulls' dtype, scale and accumulate in the shards' dtype.
    bucket_elems: bucket size in elements of the full buffers (>= 1).
    scale: multiplier after the SUM; pass 1 / world_size for a mean. != 1 needs floating shards.
    accumulate: add into shards instead of overwriting them.

Returns: CollectiveHandle. Raises RuntimeError on bad inputs (before launching anything).)doc")
      .def("all_reduce", &BucketedCollectives::all_reduce, py::arg("tensors"), py::arg("bucket_elems"),
           py::arg("scale") = 1.0, Release(), R"doc(
After wait(): ``tensors[i] = scale * sum over ranks of tensors[i]``, in place.

Args:
    tensors: list of contiguous tensors, one dtype, one device.
    bucket_elems: bucket size in elements (>= 1).
    scale: multiplier after the SUM (!= 1 needs a floating dtype).

Returns: CollectiveHandle. Raises RuntimeError on bad inputs (before launching anything).)doc");
}

}  // namespace zeroshard::python
