// zeroshard._C.BucketedCollectives / CollectiveHandle (csrc/comm/) for the Python layer. The process group is the
// torch.distributed ProcessGroup object itself: torch registers it with the intrusive_ptr holder, so it crosses as-is.
#include "comm/bucketed_collectives.h"
#include "python/bindings.h"

namespace zeroshard::python {

namespace py = pybind11;

namespace {

// {"all_gather": {...}, "reduce_scatter": {...}, "all_reduce": {...}}, wire_bytes None where the backend is unknown.
py::dict counters_to_dict(const CommCounters& counters, bool wire_known) {
  py::dict out;
  for (int k = 0; k < kNumCollectiveKinds; ++k) {
    const CollectiveCounters& c = counters[k];
    py::dict d;
    d["calls"] = c.calls;
    d["tensor_bytes"] = c.tensor_bytes;
    d["bytes"] = c.bytes;
    d["wire_bytes"] = wire_known ? py::object(py::int_(c.wire_bytes)) : py::object(py::none());
    out[collective_kind_name(static_cast<CollectiveKind>(k))] = d;
  }
  return out;
}

}  // namespace

void bind_comm(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;

  py::class_<CommStats, std::shared_ptr<CommStats>>(m, "CommStats", R"doc(
Bytes this rank sent through one BucketedCollectives, per collective kind, per step and in total.

Each kind (``all_gather``, ``reduce_scatter``, ``all_reduce``) maps to a dict of ints: ``calls`` (collectives
launched), ``tensor_bytes`` (full-buffer bytes, nccl-tests' size), ``bytes`` (what this rank sends in a ring: F (N-1)/N
for all-gather and reduce-scatter, 2 F (N-1)/N for all-reduce; what we ask of the process group) and ``wire_bytes``
(what the backend really sends: gloo emulates reduce-scatter with an all-reduce, so twice ``bytes`` there; None for
backends where it is not known). Source: ring volumes as in the ZeRO paper (Rajbhandari et al. 2020, section 7) and
nccl-tests' bus bandwidth.)doc")
      .def("end_step", &CommStats::end_step, "Closes the current step: it becomes last_step() and is added to total().")
      .def("reset", &CommStats::reset, "Forgets every count (steps, totals and the open step).")
      .def(
          "current", [](const CommStats& s) { return counters_to_dict(s.current(), s.wire_known()); },
          "Counts since the last end_step().")
      .def(
          "last_step", [](const CommStats& s) { return counters_to_dict(s.last_step(), s.wire_known()); },
          "Counts of the step closed by the last end_step().")
      .def(
          "total", [](const CommStats& s) { return counters_to_dict(s.total(), s.wire_known()); },
          "Counts of every closed step.")
      .def_property_readonly("steps", &CommStats::steps, "int: steps closed by end_step()")
      .def_property_readonly("backend", &CommStats::backend, "str: the process group's backend name")
      .def_property_readonly("world_size", &CommStats::world_size, "int: ranks of the process group")
      .def_property_readonly("wire_known", &CommStats::wire_known, "bool: wire_bytes are known for this backend");

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
      .def_property_readonly("stats", &BucketedCollectives::stats,
                             "CommStats: bytes and calls of every collective launched through this object")
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
