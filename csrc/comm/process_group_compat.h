// ProcessGroup's single-buffer collectives under the name each torch version has: torch >= 2.13 calls them
// all_gather_single / reduce_scatter_single / all_to_all_single and deprecates the old _allgather_base /
// _reduce_scatter_base / alltoall_base names, which are the only ones torch 2.11 and 2.12 have.
#pragma once

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace zeroshard::compat {

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
inline c10::intrusive_ptr<c10d::Work> all_gather_single(c10d::ProcessGroup& pg, at::Tensor& out, at::Tensor& in) {
  return pg.all_gather_single(out, in);
}
inline c10::intrusive_ptr<c10d::Work> reduce_scatter_single(c10d::ProcessGroup& pg, at::Tensor& out, at::Tensor& in,
                                                            const c10d::ReduceScatterOptions& opts) {
  return pg.reduce_scatter_single(out, in, opts);
}
inline c10::intrusive_ptr<c10d::Work> all_to_all_single(c10d::ProcessGroup& pg, at::Tensor& out, at::Tensor& in) {
  std::vector<int64_t> even;  // empty split sizes: equal chunks
  return pg.all_to_all_single(out, in, even, even);
}
#else
inline c10::intrusive_ptr<c10d::Work> all_gather_single(c10d::ProcessGroup& pg, at::Tensor& out, at::Tensor& in) {
  return pg._allgather_base(out, in);
}
inline c10::intrusive_ptr<c10d::Work> reduce_scatter_single(c10d::ProcessGroup& pg, at::Tensor& out, at::Tensor& in,
                                                            const c10d::ReduceScatterOptions& opts) {
  return pg._reduce_scatter_base(out, in, opts);
}
inline c10::intrusive_ptr<c10d::Work> all_to_all_single(c10d::ProcessGroup& pg, at::Tensor& out, at::Tensor& in) {
  std::vector<int64_t> even;  // empty split sizes: equal chunks
  return pg.alltoall_base(out, in, even, even);
}
#endif

}  // namespace zeroshard::compat
